"""`deepinfer serve`: an OpenAI-compatible HTTP server over `AsyncLLM` (FastAPI + uvicorn).

`build_app(llm, model_name, api_key=None)` is the ASGI app (app.py); `OpenAIServing` answers the
completions and chat endpoints without HTTP (serving.py), for the server and `deepinfer run-batch`;
`protocol` holds the request bodies, `params` maps them to `SamplingParams`, `chat` renders messages,
`responses` builds bodies and stream chunks, `errors` the OpenAI error shape, `metrics` Prometheus.
"""

__all__ = ["OpenAIServing", "build_app"]


def __getattr__(name: str):
    # imported on use, so `deepinfer serve --help` loads neither fastapi nor torch
    if name == "build_app":
        from .app import build_app

        return build_app
    if name == "OpenAIServing":
        from .serving import OpenAIServing

        return OpenAIServing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
