"""What a request may carry, checked against the model it runs on before anything else sees it.

Every token id a request brings (its prompt, `golden_token_ids`, `stop_token_ids`, the structured-output
trigger and bound ids) must be an integer inside the model's vocabulary, so none reaches the scheduler's
int32 arrays, the sampler's masks or the embedding out of range. A violation raises a ValueError that names
the field, the position and the allowed range: `golden_token_ids[1]=-5: must be in [0, 129280)`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..sampling_params import SamplingParams


def checked_token_id(field: str, t, vocab_size: int) -> int:
    """`t` as a Python int in [0, vocab_size); ValueError naming `field` otherwise."""
    if isinstance(t, bool | np.bool_) or not isinstance(t, int | np.integer):
        raise ValueError(f"{field}={t!r}: must be an integer token id in [0, {vocab_size})")
    if not 0 <= t < vocab_size:
        raise ValueError(f"{field}={t}: must be in [0, {vocab_size})")
    return int(t)


def checked_token_ids(field: str, ids: Iterable, vocab_size: int) -> list[int]:
    """`ids` as Python ints, each in [0, vocab_size); ValueError naming `field[i]` otherwise."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise ValueError(f"{field} must be a list of token ids, got {type(ids).__name__}")
    return [checked_token_id(f"{field}[{i}]", t, vocab_size) for i, t in enumerate(ids)]


def check_prompt(
    prompt_token_ids: list[int], vocab_size: int, max_model_len: int, image_positions=None
) -> list[int]:
    """The prompt's ids as Python ints: non-empty, in the vocabulary, shorter than max_model_len.
    `image_positions`: a request with images, True per position its image expansion wrote (those hold
    the sentinel ids past the vocabulary and are the expansion's own; every other id is checked)."""
    if image_positions is None:
        ids = checked_token_ids("prompt_token_ids", prompt_token_ids, vocab_size)
    else:
        ids = [
            int(t) if image else checked_token_id(f"prompt_token_ids[{i}]", t, vocab_size)
            for i, (t, image) in enumerate(zip(prompt_token_ids, image_positions, strict=True))
        ]
    if not ids:
        raise ValueError("prompt must not be empty")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt is {len(ids)} tokens; it must be shorter than max_model_len={max_model_len}"
        )
    return ids


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """The token ids of the sampling parameters (their other fields were checked when they were built)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams or a dict, got {type(params).__name__}")
    if params.golden_token_ids is not None:
        checked_token_ids("golden_token_ids", params.golden_token_ids, vocab_size)
    checked_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    so = params.so_args
    if so is not None:
        _check_so_args(so, vocab_size)


def _check_so_args(so_args: dict, vocab_size: int) -> None:
    """The structured-output request as `deepinfer_structured` parses it (every rule that needs no
    tokenizer), then its trigger and bound ids against the vocabulary."""
    from deepinfer_structured import parse_so_args

    request = parse_so_args(so_args)
    checked_token_ids("so_args['trigger_token_ids']", request.trigger_token_ids, vocab_size)
    if request.bound_token_id is not None:
        checked_token_id("so_args['bound_token_id']", request.bound_token_id, vocab_size)
