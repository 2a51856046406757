"""A request's fields as `SamplingParams`: OpenAI's names mapped to the engine's, every range checked once,
by `SamplingParams` itself, and its errors reported under the request's name for the field."""

from __future__ import annotations

from ..sampling_params import SamplingParams
from .errors import APIError, bad_request, from_value_error
from .protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs

# copied as they are when given
_PASSED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "allowed_token_ids",
    "bad_words",
    "logit_bias",
)


def structured_outputs(req: CompletionRequest | ChatCompletionRequest) -> dict | None:
    """`response_format` (OpenAI's) or `so_args` (the reference's: regex, EBNF, ...) as so_args."""
    fmt: ResponseFormat | None = req.response_format
    if fmt is not None and fmt.type != "text" and req.so_args is not None:
        raise bad_request("give response_format or so_args, not both", "response_format")
    if fmt is None or fmt.type == "text":
        return req.so_args
    if fmt.type == "json_object":
        return {"schema_type": "json_object"}
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise bad_request(
            "response_format.json_schema.schema is required for type json_schema",
            "response_format.json_schema",
        )
    return {"schema_type": "json_schema", "schema": fmt.json_schema.json_schema}


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    names: dict[str, str],
    so_args: dict | None = None,
    prompt_logprobs: int | None = None,
    stop: tuple[str, ...] = (),
) -> SamplingParams:
    """names: the engine's field name -> the request's, for the fields the two endpoints name apart;
    so_args: a constraint of the server's own (a forced tool call) in place of the request's;
    prompt_logprobs: the prompt's logprobs with this many alternatives (completions' echo);
    stop: stop strings of the server's own (one tool call only) besides the request's."""
    kwargs = {"n": req.n, "max_tokens": max_tokens, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
    kwargs.update({name: getattr(req, name) for name in _PASSED if getattr(req, name) is not None})
    if stop:
        given = kwargs.get("stop") or []
        given = [given] if isinstance(given, str) else list(given)
        kwargs["stop"] = given + [s for s in stop if s not in given]
    if req.seed is not None:
        kwargs["seq_seed"] = req.seed
    kwargs["so_args"] = so_args if so_args is not None else structured_outputs(req)
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise from_value_error(ValueError(str(e)), field_names(names)) from None


def field_names(names: dict[str, str]) -> dict[str, str]:
    fields = {name: name for name in (*_PASSED, "n", "so_args")} | {"prompt_logprobs": "echo"}
    fields.update(seq_seed="seed", seed="seed")
    fields.update(names)
    return fields


def completion_logprobs(req: CompletionRequest) -> int | None:
    if req.logprobs is None:
        return None
    _check_range("logprobs", req.logprobs)
    return req.logprobs


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        _check_range("top_logprobs", req.top_logprobs)
    return (req.top_logprobs or 0) if req.logprobs else None


def _check_range(name: str, value: int) -> None:
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value}", name)


def max_new_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, param: str, prompt_param: str
) -> int:
    """The tokens a request may generate: `requested`, or all the context left when it gives none.
    A prompt that leaves no room, or a request for more than the context holds, is a 400."""
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len}",
            "invalid_request_error",
            prompt_param,
            "context_length_exceeded",
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len} "
            f"and {param}={requested} asks for more than the {room} left",
            "invalid_request_error",
            param,
            "context_length_exceeded",
        )
    return requested
