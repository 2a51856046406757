"""The FastAPI application: OpenAI's routes over `OpenAIServing`, `/health`, Prometheus `/metrics`, the API key.

A non-streaming request whose client disconnects is cancelled (its engine requests aborted, their blocks
freed) instead of running to the end for nobody; a streaming one ends when its response can no longer be
sent, which closes the event iterator and aborts the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ..async_llm import AsyncLLM
from .errors import install_handlers, unauthorized
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import OpenAIServing


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app serving `llm` as `model_name`; with `api_key`, /v1 routes need `Authorization: Bearer KEY`.
    Its shutdown closes `llm`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await llm.close()

    app = FastAPI(title="DeepInfer", lifespan=lifespan)
    install_handlers(app)
    serving = OpenAIServing(llm, model_name)
    metrics = ServerMetrics(llm, model_name)
    app.state.llm, app.state.serving, app.state.metrics = llm, serving, metrics

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise unauthorized()

    v1 = [Depends(check_key)]

    @app.get("/health")
    async def health() -> Response:
        if llm.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict:
        return serving.models()

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, serving.completions(body))

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, serving.chat(body))

    return app


async def _respond(request: Request, call) -> Response:
    result = await _unless_disconnected(request, call)
    if isinstance(result, Response):
        return result
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _unless_disconnected(request: Request, call):
    """`call`'s result, or a bare 499 after cancelling it when the client goes away first."""
    task = asyncio.ensure_future(call)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)  # nobody reads it: the client closed the connection


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
