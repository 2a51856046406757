"""`deepinfer serve`: build the engine, then serve it with uvicorn on one event loop."""

from __future__ import annotations

import argparse
import os
import socket

from ..engine_args import EngineArgs


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, loopback only)"
    )
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $DEEPINFER_API_KEY; unset: no key)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="requests that may wait for their first token at once; more get 503 (default: no bound)",
    )
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    EngineArgs.add_cli_args(parser)


def make_app(args: argparse.Namespace):
    """The engine and the app `args` describe (the model is loaded here)."""
    from .. import envs
    from ..async_llm import AsyncLLM
    from .app import build_app

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    engine_args = EngineArgs.from_cli_args(args)
    api_key = args.api_key if args.api_key is not None else envs.DEEPINFER_API_KEY
    llm = AsyncLLM(max_waiting_requests=args.max_waiting_requests, **engine_args.fields())
    return build_app(llm, engine_args.served_model_name, api_key=api_key or None)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="deepinfer serve",
        description="An OpenAI-compatible HTTP server (/v1/models, /v1/completions, /v1/chat/completions, "
        "/health, /metrics) over the engine.",
    )
    add_serve_args(parser)
    return run_serve(parser.parse_args(argv))


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    app = make_app(args)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    print(f"deepinfer serve: http://{host}:{port}/v1 (model {app.state.serving.model_name!r})", flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
