"""`OpenAIServing`: the completions and chat endpoints over one `AsyncLLM`, free of HTTP.

Each call checks the whole request first (model, fields, prompt lengths) and admits its prompts to the
engine all or none, so a bad request raises an `APIError` before any of it runs. It then returns the
response body, or for `stream=true` an async iterator of server-sent events. Leaving that iterator early
(a client that disconnects) aborts the request's engine requests and frees their blocks; the server and
`deepinfer run-batch` both call these methods.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..async_llm import AsyncLLM, EngineDeadError, QueueFullError
from ..outputs import RequestOutput
from ..reasoning import THINK_END, starts_in_reasoning
from ..sampling_params import SamplingParams
from . import responses
from .chat import render_messages
from .errors import APIError, bad_request, from_value_error, model_not_found, overloaded, server_error
from .params import chat_logprobs, completion_logprobs, field_names, max_new_tokens, sampling_params
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import ChoiceCursor, TokenText, sse
from .tools import plan_tools


@dataclass
class _Job:
    text: str | None
    ids: list[int]
    params: SamplingParams
    images: list | None = None  # a chat's images: the engine expands `text` with them at admission


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm, self.model_name = llm, model_name
        self.token_text = TokenText(llm.tokenizer)

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "deepinfer"}],
        }

    # ------------------------------------------------------------------ /v1/completions
    async def completions(self, req: CompletionRequest) -> dict | AsyncIterator[str]:
        self._check_model(req.model)
        if req.suffix is not None:
            raise bad_request(
                "suffix is not supported: this model has no fill-in-the-middle mode (no documented format "
                "for its tokenizer's FIM tokens)",
                "suffix",
            )
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of must equal n ({req.n}) or be left out", "best_of")
        logprobs = completion_logprobs(req)
        # echo with logprobs: the prompt's tokens scored too, from the prefill's logits
        echo_logprobs = logprobs if req.echo else None
        names = {"logprobs": "logprobs", "max_tokens": "max_tokens"}
        jobs = []
        for text, ids in self._prompts(req.prompt):
            limit = max_new_tokens(req.max_tokens, len(ids), self.llm.max_model_len, "max_tokens", "prompt")
            params = sampling_params(req, limit, logprobs, names, prompt_logprobs=echo_logprobs)
            jobs.append(_Job(text, ids, params))
        rid, streams = await self._admit(jobs, "cmpl", names)
        created = int(time.time())
        echo = [
            (j.text if j.text is not None else self.llm.tokenizer.decode(j.ids)) if req.echo else ""
            for j in jobs
        ]

        def choice(p: int, out: RequestOutput, c, cur: ChoiceCursor) -> dict:
            start, end = cur.tokens, len(c.token_ids)
            lp = None
            if logprobs is not None:
                # offsets index the choice's whole text: the echoed prompt, then the completion
                lp = responses.completion_logprobs(c, start, end, self.token_text, len(echo[p]) + cur.text)
                if echo_logprobs is not None and not cur.started:
                    bos = self.llm.engine.bos_token_id
                    lp = responses.joined_logprobs(
                        responses.prompt_logprobs(out, echo_logprobs, self.token_text, bos), lp
                    )
            return {
                "index": p * req.n + c.index,
                "text": ("" if cur.started else echo[p]) + c.text[cur.text :],
                "logprobs": lp,
                "finish_reason": c.finish_reason,
            }

        def body(choices: list[dict]) -> dict:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }

        if req.stream:
            return self._stream(streams, choice, body, req.n, _include_usage(req))
        outs = await self._finals(streams)
        choices = [choice(p, out, c, ChoiceCursor()) for p, out in enumerate(outs) for c in out.outputs]
        return body(choices) | {"usage": _usage(outs)}

    # ------------------------------------------------------------------ /v1/chat/completions
    async def chat(self, req: ChatCompletionRequest) -> dict | AsyncIterator[str]:
        self._check_model(req.model)
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise bad_request("give max_completion_tokens or max_tokens, not both", "max_tokens")
        requested, param = req.max_completion_tokens, "max_completion_tokens"
        if requested is None and req.max_tokens is not None:
            requested, param = req.max_tokens, "max_tokens"
        logprobs = chat_logprobs(req)
        tools = plan_tools(req)
        prompt, images = render_messages(
            req.messages,
            self.llm.tokenizer_config,
            req.add_generation_prompt,
            req.chat_template_kwargs,
            tools.tools,
        )
        # with images, the text's ids only: the image blocks are added at admission, and the engine
        # then holds max_tokens to the context the expanded prompt leaves
        # thinking mode: the completion starts inside the reasoning, sent apart as reasoning_content
        thinking = starts_in_reasoning(prompt)
        forced_call = tools.so_args(thinking, self.llm.tokenizer.token_to_id(THINK_END))
        ids = self.llm.engine.encode(prompt)
        limit = max_new_tokens(requested, len(ids), self.llm.max_model_len, param, "messages")
        names = {
            "logprobs": "top_logprobs",
            "max_tokens": param,
            "prompt": "messages",
            "prompt_token_ids": "messages",
            "multi_modal_data": "messages",
        }
        params = sampling_params(req, limit, logprobs, names, forced_call, stop=tools.stop)
        job = _Job(prompt, ids, params, images or None)
        rid, streams = await self._admit([job], "chatcmpl", names)
        created = int(time.time())

        def choice(p: int, out: RequestOutput, c, cur: ChoiceCursor, stream: bool = True) -> dict:
            lp = (
                None
                if logprobs is None
                else responses.chat_logprobs(c, cur.tokens, len(c.token_ids), self.token_text)
            )
            text, finish_reason = c.text[cur.text :], c.finish_reason
            if stream:
                delta = responses.chat_delta(text, cur, thinking, c.finished)
                if tools.read_calls:
                    delta = responses.tool_call_delta(delta, cur, c.finished)
                    finish_reason = responses.stream_finish_reason(cur, finish_reason)
                return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            message = responses.chat_message(text, thinking)
            if tools.read_calls:
                message, finish_reason = responses.with_tool_calls(message, finish_reason)
            return {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish_reason}

        def chunk(choices: list[dict]) -> dict:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }

        if req.stream:
            return self._stream(streams, choice, chunk, req.n, _include_usage(req))
        outs = await self._finals(streams)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": [choice(0, outs[0], c, ChoiceCursor(), stream=False) for c in outs[0].outputs],
            "usage": _usage(outs),
        }

    # ------------------------------------------------------------------ shared
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    def _prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        """A completions `prompt` (text, token ids, or a list of either) as (text, ids) pairs."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, self.llm.engine.encode(p)))
            else:
                out.append((None, list(p)))
        return out

    async def _admit(self, jobs: list[_Job], prefix: str, names: dict[str, str]) -> tuple[str, list]:
        """Every job admitted, or none (an APIError naming the problem)."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        streams = []
        try:
            for i, job in enumerate(jobs):
                request_id = rid if len(jobs) == 1 else f"{rid}-{i}"
                if job.images is None:
                    stream = await self.llm.add_request(
                        job.text, job.params, request_id, prompt_token_ids=job.ids
                    )
                else:
                    stream = await self.llm.add_request(
                        job.text, job.params, request_id, multi_modal_data={"image": job.images}
                    )
                streams.append(stream)
        except BaseException as e:
            for s in streams:
                self.llm.abort(s.request_id)
            if isinstance(e, QueueFullError):
                raise overloaded(str(e)) from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), "server_error", None, "engine_dead") from None
            if isinstance(e, ValueError):
                fields = field_names(names) | {"prompt_token_ids": names.get("prompt_token_ids", "prompt")}
                raise from_value_error(e, fields) from None
            raise
        return rid, streams

    async def _finals(self, streams) -> list[RequestOutput]:
        async def last(stream):
            out = None
            async for snapshot in stream:
                out = snapshot
            return out

        try:
            outs = await asyncio.gather(*(last(s) for s in streams))
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error", None, "engine_dead") from None
        finally:
            for s in streams:
                if not s.finished:
                    self.llm.abort(s.request_id)
        for out in outs:
            if out.error is not None:
                raise server_error(f"the request failed in the engine: {out.error}")
        return outs

    async def _stream(self, streams, choice, body, n: int, include_usage: bool) -> AsyncIterator[str]:
        cursors: dict[int, ChoiceCursor] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            async for p, out, error in _merged(streams):
                if error is None and out.error is not None:
                    error = server_error(f"the request failed in the engine: {out.error}")
                if error is not None:
                    if not isinstance(error, APIError):
                        error = APIError(503, str(error), "server_error", None, "engine_dead")
                    yield sse(error.body())
                    break
                if out.finished:
                    finals[p] = out
                for c in out.outputs:
                    cur = cursors.setdefault(p * n + c.index, ChoiceCursor())
                    if cur.finished or (
                        cur.started
                        and len(c.text) == cur.text
                        and len(c.token_ids) == cur.tokens
                        and not c.finished
                    ):
                        continue
                    yield sse(body([choice(p, out, c, cur)]))
                    cur.text, cur.tokens, cur.started, cur.finished = (
                        len(c.text),
                        len(c.token_ids),
                        True,
                        c.finished,
                    )
            else:
                if include_usage:
                    yield sse(body([]) | {"usage": _usage(list(finals.values()))})
            yield sse("[DONE]")
        finally:
            for s in streams:
                if not s.finished:
                    self.llm.abort(s.request_id)


async def _merged(streams) -> AsyncIterator[tuple[int, RequestOutput | None, BaseException | None]]:
    """(prompt index, output, None) as any stream advances, or (index, None, error) when one fails."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which ends the response with it
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, out, error = await queue.get()
            if error is not None or out.finished:
                remaining -= 1
            yield i, out, error
    finally:
        for t in tasks:
            t.cancel()


def _include_usage(req) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _usage(outs: list[RequestOutput]) -> dict:
    return responses.usage(
        sum(len(o.prompt_token_ids) for o in outs), sum(len(c.token_ids) for o in outs for c in o.outputs)
    )
