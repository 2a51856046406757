"""Throughput accounting of the benchmark rows (one formula per function, so tests can check each).

Decode follows the reference's headline: tokens/s/GPU = average steps/s × batch × (1 + nextn) / cp,
which counts every draft token as accepted ("full acceptance"). The measured figure counts the tokens
the engine really emitted. Both go in every decode row, each named for its accounting.
"""

from __future__ import annotations

from deepinfer_spec import full_acceptance_tokens_per_s


def _check_parallel(dp: int, cp: int) -> None:
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")


def prefill_tok_per_s_per_gpu(non_cached_tokens: int, seconds: float, dp: int = 1, cp: int = 1) -> float:
    """Prompt tokens computed (prefix-cache hits excluded) per second per GPU; dp × cp GPUs run them."""
    _check_parallel(dp, cp)
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if non_cached_tokens < 0:
        raise ValueError(f"non_cached_tokens must be >= 0, got {non_cached_tokens}")
    return non_cached_tokens / seconds / (dp * cp)


def decode_full_acceptance_per_gpu(
    steps_per_s: float, batch: int, nextn: int, dp: int = 1, cp: int = 1
) -> float:
    """The reference's formula with batch per DP rank: steps/s × (batch / dp) × (1 + nextn) / cp."""
    _check_parallel(dp, cp)
    return full_acceptance_tokens_per_s(steps_per_s, batch / dp, nextn, cp)


def decode_measured_per_gpu(emitted_tokens: int, seconds: float, dp: int = 1, cp: int = 1) -> float:
    """Tokens the engine emitted (accepted drafts included, rejected ones not) per second per GPU."""
    _check_parallel(dp, cp)
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return emitted_tokens / seconds / (dp * cp)


def decode_full_acceptance_per_user(steps_per_s: float, nextn: int) -> float:
    """One request's rate when all its drafts are accepted: steps/s × (1 + nextn)."""
    if nextn < 0:
        raise ValueError(f"nextn must be >= 0, got {nextn}")
    return steps_per_s * (1 + nextn)


def decode_measured_per_user(emitted_tokens: int, seconds: float, batch: int) -> float:
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return emitted_tokens / seconds / batch


ACCOUNTING_TEXT = {
    "full": "decode: full-acceptance accounting, tok/s/GPU = steps/s x batch x (1+nextn) / cp "
    "(every draft counted as accepted)",
    "measured": "decode: measured accounting, tok/s/GPU = emitted tokens / s / GPUs (real acceptance)",
    "prefill": "prefill: non-cached prompt tokens / s / GPU; latency = wall time of one chunk",
}
