"""What a KV tier entry depends on besides its tokens, as one name: entries of a disk directory are kept
under it, so engines that would compute other values for the same prefix never share them."""

from __future__ import annotations

import json
from pathlib import Path

import xxhash
from deepinfer_model import cache_layout

from .. import envs


def tier_fingerprint(model_path: Path, args, runner, truncation, device) -> str:
    """xxh3-64 (hex) of the checkpoint (config, weight file names, sizes and modification times), the
    compute dtype, the device kind, the numerics settings, YOCO truncation and the pool layout."""
    return fingerprint_of(cache_facts(model_path, args, runner, truncation, device))


def fingerprint_of(facts: dict) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(facts, sort_keys=True, default=str).encode())


def cache_facts(model_path: Path, args, runner, truncation, device) -> dict:
    """The facts `tier_fingerprint` hashes, by name (a hand-off carries them, so a refusal can say which
    one differs); JSON-compatible values."""
    model_path = Path(model_path)
    weights = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_path.glob("*.safetensors")
    )
    facts = dict(
        config=(model_path / "config.json").read_text(),
        weights=weights,
        dtype=args.dtype,
        device=str(device.type),
        block_size=args.block_size,
        numerics=envs.DEEPINFER_NUMERICS,
        batch_invariant=bool(envs.DEEPINFER_BATCH_INVARIANT),
        accelerator=envs.DEEPINFER_ACCELERATOR,
        yoco=repr(truncation.settings) if truncation.enabled else None,
        layout=[list(vars(p).values()) for p in cache_layout(runner.cache)],
    )
    return json.loads(json.dumps(facts, default=str))
