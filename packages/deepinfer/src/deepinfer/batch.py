"""`deepinfer run-batch -i requests.jsonl -o results.jsonl`: OpenAI's batch file format, run on the engine.

Each input line is `{"custom_id": str, "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}`; each gets one output line `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}`, its body what the server would answer (a 4xx error body for a bad request).
The input is checked whole before the model loads (one line naming the first problem). Results are
appended and flushed as they finish, so a run that stops can be resumed: the custom_ids already in the
output are skipped (a torn last line is dropped). Once every line has its result, the output is
rewritten in input order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from .engine_args import EngineArgs

URLS = ("/v1/completions", "/v1/chat/completions")


class BatchInputError(ValueError):
    """The input file is not a valid batch (names the line and the problem)."""


@dataclass
class BatchLine:
    custom_id: str
    url: str
    body: dict


def read_batch(path: Path) -> list[BatchLine]:
    lines, seen = [], set()
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as e:
            raise BatchInputError(f"{where}: invalid JSON: {e}") from None
        if not isinstance(record, dict):
            raise BatchInputError(f"{where}: must be a JSON object")
        custom_id = record.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchInputError(f"{where}: custom_id must be a non-empty string")
        if custom_id in seen:
            raise BatchInputError(f"{where}: custom_id {custom_id!r} appears twice")
        seen.add(custom_id)
        if record.get("method", "POST") != "POST":
            raise BatchInputError(f"{where}: method must be POST, got {record.get('method')!r}")
        if record.get("url") not in URLS:
            raise BatchInputError(f"{where}: url must be one of {list(URLS)}, got {record.get('url')!r}")
        if not isinstance(record.get("body"), dict):
            raise BatchInputError(f"{where}: body must be a JSON object")
        lines.append(BatchLine(custom_id, record["url"], record["body"]))
    return lines


def read_done(path: Path) -> dict[str, str]:
    """custom_id -> its result line, of an earlier run's output; a torn last line is cut off the file."""
    if not path.exists():
        return {}
    done, good_bytes = {}, 0
    with path.open("rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
                custom_id = record["custom_id"]
            except (json.JSONDecodeError, KeyError, TypeError):
                break
            if not raw.endswith(b"\n"):
                break
            done[custom_id] = raw.decode().rstrip("\n")
            good_bytes += len(raw)
    if good_bytes != path.stat().st_size:
        with path.open("r+b") as f:
            f.truncate(good_bytes)
    return done


async def run_line(serving, line: BatchLine) -> dict:
    """One input line's result record (the server's answer to its body)."""
    from pydantic import ValidationError

    from .serve.errors import APIError, bad_request, from_validation_errors
    from .serve.protocol import ChatCompletionRequest, CompletionRequest

    request_id = f"batch_req_{uuid.uuid4().hex}"
    try:
        if line.body.get("stream"):
            raise bad_request("stream is not supported in a batch", "stream")
        if line.url == "/v1/completions":
            body = await serving.completions(CompletionRequest.model_validate(line.body))
        else:
            body = await serving.chat(ChatCompletionRequest.model_validate(line.body))
        status = 200
    except ValidationError as e:
        err = from_validation_errors(e.errors())
        status, body = err.status, err.body()
    except APIError as e:
        status, body = e.status, e.body()
    return {
        "id": request_id,
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


async def run_batch(
    llm, model_name: str, lines: list[BatchLine], output: Path, max_concurrency: int, progress: bool
) -> int:
    """Run the lines the output lacks; returns how many results are not 200 (over the whole file)."""
    from tqdm import tqdm

    from .serve.serving import OpenAIServing

    serving = OpenAIServing(llm, model_name)
    done = read_done(output)
    todo = [line for line in lines if line.custom_id not in done]
    bar = tqdm(
        total=len(lines), initial=len(lines) - len(todo), desc="run-batch", unit="req", disable=not progress
    )
    gate = asyncio.Semaphore(max_concurrency)
    with output.open("a") as f:

        async def one(line: BatchLine) -> None:
            async with gate:
                record = await run_line(serving, line)
            text = json.dumps(record, ensure_ascii=False)
            f.write(text + "\n")
            f.flush()
            done[line.custom_id] = text
            bar.update(1)

        try:
            await asyncio.gather(*(one(line) for line in todo))
        finally:
            bar.close()
    ordered = [done[line.custom_id] for line in lines]
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text("".join(text + "\n" for text in ordered))
    os.replace(tmp, output)
    return sum(json.loads(text)["response"]["status_code"] != 200 for text in ordered)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="deepinfer run-batch",
        description="Run an OpenAI batch file (one request per line: custom_id, method, url, body) on the "
        "engine; one result line per input line. Resumable: results already in the output are kept.",
    )
    parser.add_argument("-i", "--input-file", type=Path, required=True, help="requests, JSONL")
    parser.add_argument("-o", "--output-file", type=Path, required=True, help="results, JSONL (appended to)")
    parser.add_argument(
        "--max-concurrency", type=int, default=256, help="requests in the engine at once (default: 256)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    if args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    try:
        lines = read_batch(args.input_file)
    except (BatchInputError, OSError) as e:
        print(f"deepinfer run-batch: {e}", file=sys.stderr)
        return 2
    from .async_llm import AsyncLLM

    engine_args = EngineArgs.from_cli_args(args)

    async def go() -> int:
        async with AsyncLLM(**engine_args.fields()) as llm:
            return await run_batch(
                llm,
                engine_args.served_model_name,
                lines,
                args.output_file,
                args.max_concurrency,
                not args.no_progress,
            )

    failed = asyncio.run(go())
    print(
        f"deepinfer run-batch: {len(lines)} results in {args.output_file}, {failed} not 200", file=sys.stderr
    )
    return 1 if failed else 0
