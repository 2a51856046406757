"""The reference's speculative-decoding knobs (engine spec §1.5), read and validated in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping

DEFAULT_NEXTN = 5
MAX_NEXTN = 32  # the drafter's block is at most 32 tokens (v41 spec §7)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def nextn_from_env(environ: Mapping[str, str] | None = None) -> int:
    """`DEEPINFER_USE_NEXTN_DECODE` (default 5; 0 disables speculative decoding)."""
    raw = (os.environ if environ is None else environ).get("DEEPINFER_USE_NEXTN_DECODE", str(DEFAULT_NEXTN))
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(
            f"DEEPINFER_USE_NEXTN_DECODE must be an integer in [0, {MAX_NEXTN}], got {raw!r}"
        ) from None
    if not 0 <= value <= MAX_NEXTN:
        raise ValueError(f"DEEPINFER_USE_NEXTN_DECODE must be an integer in [0, {MAX_NEXTN}], got {raw!r}")
    return value


def varlen_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """`DEEPINFER_ENABLE_MTP_VARLEN` (default off)."""
    raw = (os.environ if environ is None else environ).get("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"DEEPINFER_ENABLE_MTP_VARLEN must be 0/1 (or true/false), got {raw!r}")
