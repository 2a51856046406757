"""`LLM`: the offline entry point (generate / chat over many prompts at once)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from tqdm import tqdm

from .chat_images import split_image_parts
from .engine.images import check_takes_images
from .engine.llm_engine import LLMEngine
from .engine_args import EngineArgs
from .outputs import RequestMetrics, RequestOutput
from .prompt_inputs import parse_prompts
from .sampling_params import SamplingParams
from .tokenizer import ChatTokenizer, render_chat

logger = logging.getLogger("deepinfer")


class LLM:
    """`LLM(model=None, **engine_args)`; with no model (and no $DEEPINFER_HF_MODEL_DIR) it runs the
    built-in random-weight `deepinfer-tiny`.

    A parallel layout (`expert_parallel_size`, `data_parallel_size`, `context_parallel_size`, derived as
    the reference derives them) runs one engine per rank: in a process started by `deepinfer launch` or
    torchrun (RANK / WORLD_SIZE set) this process is one rank and every rank calls `generate` with the same
    prompts (engine/launched.py); otherwise this process spawns the ranks on this host and fronts them
    (engine/data_parallel.py)."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        args = EngineArgs(model=model, **kwargs)
        if args.launched is not None:  # this process is one rank of a launched world
            from .engine.launched import LaunchedEngine

            self.engine = LaunchedEngine(args)
        elif args.disaggregation != "off":  # a prompt and a completion engine process behind a front
            from .engine.disaggregated import DisaggregatedEngine

            self.engine = DisaggregatedEngine(args)
        elif args.world_size > 1:  # one engine per rank process; this process only fronts them
            from .engine.data_parallel import DataParallelEngine

            self.engine = DataParallelEngine(args)
        else:
            self.engine = LLMEngine.from_engine_args(args)
        self._counter = 0

    @classmethod
    def from_engine(cls, engine) -> LLM:
        """An `LLM` over an engine built by the caller (e.g. with its own `num_speculative_tokens`)."""
        llm = cls.__new__(cls)
        llm.engine, llm._counter = engine, 0
        return llm

    def get_tokenizer(self) -> ChatTokenizer:
        """The checkpoint's tokenizer: `encode(text)` -> ids (as `generate` tokenizes a text prompt),
        `decode(ids)` -> text, `apply_chat_template(messages)`."""
        engine = self.engine
        return ChatTokenizer(
            engine.tokenizer, engine.tokenizer_config, engine.bos_token_id, engine.eos_token_id
        )

    def generate(
        self,
        prompts=None,
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
        raise_on_error: bool = True,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in input order.

        prompts: one prompt or a list; a prompt is a str, a list of token ids, `{"prompt": str}` or
        `{"prompt_token_ids": list[int]}` (prompt_inputs.py). `prompt_token_ids` is the older way to
        pass token prompts.

        A dict prompt may carry `"multi_modal_data": {"image": [bytes | PIL image | path, ...]}` (a model
        with a vision tower): each image takes the next `<image>` of the text prompt (more images than
        placeholders is an error; extra placeholders stay text) or, in a `prompt_token_ids` prompt, the
        next image placeholder id (`vocab_size + 2`; as many as images). The prompt is expanded to the
        image token layout when the request is added (engine/images.py).

        As in vLLM, an invalid request (malformed prompt, bad sampling parameters given as a dict,
        empty or too long prompt, any token id outside the vocabulary: prompt, golden, stop or so_args
        ids; `so_args` that do not compile) raises a ValueError naming the request's index before any
        request runs. With `raise_on_error=False` such a request gets `error` set and empty `outputs`
        instead, and the others complete. A request that fails while running (its step: the forward,
        sampling, detokenizing or its grammar) always comes back with `error` set, without disturbing
        the others.
        """
        parsed = parse_prompts(prompts, prompt_token_ids)
        count = len(parsed)
        params_list = _normalise_params(sampling_params, count)
        engine = self.engine

        prepared: list[tuple] = []
        for i, prompt in enumerate(parsed):
            ids, mm = prompt.token_ids, prompt.multi_modal_data
            try:
                if prompt.error is not None:
                    raise ValueError(prompt.error)
                p = params_list[i]
                p = SamplingParams(**p) if isinstance(p, dict) else p.clone()
                if mm is not None:  # (a request with images is expanded and checked when it is added)
                    check_takes_images(engine)
                else:
                    if ids is None:
                        ids = engine.encode(prompt.text)
                    ids = engine.validate_request(ids, p)
                prepared.append((prompt.text, ids, p, mm, None))
            except (ValueError, TypeError) as e:
                if raise_on_error:
                    raise ValueError(f"request {i}: {e}") from e
                prepared.append((prompt.text, ids, None, None, str(e)))

        prepared = _prepare_images(engine, prepared, use_tqdm)
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for i, (prompt, ids, p, mm, error) in enumerate(prepared):
            rid = str(self._counter)
            self._counter += 1
            order.append(rid)
            if error is None:
                try:
                    if mm is None:
                        engine.add_request(rid, prompt, p, prompt_token_ids=ids)
                    else:
                        engine.add_request(rid, prompt, p, prompt_token_ids=ids, multi_modal_data=mm)
                    continue
                except ValueError as e:  # found only on admission (so_args that do not compile, images)
                    if raise_on_error:  # nothing of the call runs
                        engine.abort_all()  # the requests of this call already added
                        raise ValueError(f"request {i}: {e}") from e
                    error = str(e)
            results[rid] = RequestOutput(
                rid, prompt, ids or [], [], RequestMetrics(arrival_time=0.0), error=error
            )

        bar = tqdm(total=count, desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        bar.update(len(results))
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    results[out.request_id] = out
                    bar.update(1)
                if use_tqdm and engine.stats.steps:
                    bar.set_postfix(tok=engine.stats.generated_tokens, refresh=False)
        except KeyboardInterrupt:
            try:
                engine.abort_all()  # frees every block; the engine stays usable
            except Exception as e:  # noqa: BLE001 - the interrupt is what the caller must see
                # (an interrupt inside a step can leave that step half-processed)
                logger.warning(
                    "interrupted inside a step; the engine could not be reset (%s): make a new LLM", e
                )
            raise
        finally:
            bar.close()
        return [results[rid] for rid in order]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template, then `generate`.

        Messages have role system, user, assistant (optionally with OpenAI-style `tool_calls`) or
        tool. chat_template_kwargs: template variables, e.g. `{"thinking": True}` for DeepSeek's
        reasoning mode (the prompt ends in `<think>`) or `{"thinking": False}` to answer directly
        (`</think>`); without it the plain format of the checkpoint's template. tools: OpenAI-style
        function definitions the model may call (`deepinfer.parse_tool_calls` reads its calls).

        A message's content may be a list of OpenAI-style parts, `text` and `image_url` (a `data:` URL, a
        `file://` URL or a local path; chat_images.py): each image part becomes an `<image>` with that
        image. Malformed parts raise (naming the conversation) or, with `raise_on_error=False`, give that
        conversation's output `error`; the others run."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts, errors = [], {}
        for i, c in enumerate(conversations):
            try:
                c, images = split_image_parts(c, f"conversation {i}")
            except ValueError as e:
                if kwargs.get("raise_on_error", True):
                    raise ValueError(f"request {i}: {e}") from e
                errors[i] = str(e)
                continue
            text = render_chat(
                c, self.engine.tokenizer_config, add_generation_prompt, chat_template_kwargs, tools
            )
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        params = sampling_params
        if errors and isinstance(params, Sequence) and not isinstance(params, dict):
            params = [p for i, p in enumerate(params) if i not in errors]
        outs = iter(self.generate(prompts, params, use_tqdm=use_tqdm, **kwargs) if prompts else [])
        return [
            RequestOutput(f"chat-error-{i}", None, [], [], RequestMetrics(arrival_time=0.0), error=errors[i])
            if i in errors
            else next(outs)
            for i in range(len(conversations))
        ]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _normalise_params(sampling_params, count: int) -> list:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams | dict):
        return [sampling_params] * count
    if len(sampling_params) != count:
        raise ValueError(f"sampling_params has {len(sampling_params)} entries for {count} prompts")
    return list(sampling_params)


def _prepare_images(engine, prepared: list[tuple], use_tqdm: bool) -> list[tuple]:
    """Every request's images read and preprocessed in one batch over the worker pool (rather than one
    request at a time as each is added), so that the workers stay busy and an image that many requests
    carry is preprocessed once; admission then only runs the vision tower."""
    with_images = [i for i, (_, _, _, mm, error) in enumerate(prepared) if mm is not None and error is None]
    if not with_images:
        return prepared
    requests = [prepared[i][3] for i in with_images]
    images = [mm.get("image") if isinstance(mm, dict) else None for mm in requests]
    count = sum(len(v) if isinstance(v, list | tuple) else 1 for v in images if v is not None)
    with tqdm(
        total=count, desc="images", unit="img", disable=not use_tqdm or count < 8, dynamic_ncols=True
    ) as bar:
        ready = engine.images.prepare_many(requests, on_done=bar.update)
    prepared = list(prepared)
    for i, images in zip(with_images, ready, strict=True):
        prompt, ids, p, _, error = prepared[i]
        prepared[i] = (prompt, ids, p, images, error)
    return prepared
