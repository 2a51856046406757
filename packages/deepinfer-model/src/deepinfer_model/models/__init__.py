"""Whole models of the DeepSeek-V4 family, and `load_model`, which picks one by `config.json`'s model_type."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from ..config import ConfigError

# model_type -> module exposing `load_model(path, dtype, device)`; imported on first use.
MODEL_MODULES = {
    "deepseek_v4": "deepinfer_model.models.deepseek_v4",
    "deepseek_v41": "deepinfer_model.models.deepseek_v41",
}


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """Load a checkpoint directory into the model named by its `config.json` model_type, with its weights
    on `device` (`cpu`, `cuda`, `cuda:N` or `auto`; the forward runs where the weights are)."""
    from ..runtime.device import resolve_device

    module = MODEL_MODULES[_model_type(path)]
    return importlib.import_module(module).load_model(path, dtype, resolve_device(device))


def check_checkpoint_context_parallel(path: str | Path, yoco_enabled: bool) -> None:
    """ValueError, before any rank loads it, when the checkpoint's model cannot run context-parallel
    steps (the rule the runner applies: `family.check_context_parallel`)."""
    from ..family import check_context_parallel, family_for_type

    check_context_parallel(family_for_type(_model_type(path)), yoco_enabled)


def _model_type(path: str | Path) -> str:
    """`config.json`'s model_type, one of MODEL_MODULES."""
    file = Path(path) / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
    try:
        model_type = json.loads(file.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(f"{file} is not a valid JSON object: {e}") from e
    if model_type not in MODEL_MODULES:
        raise ConfigError(f"config key 'model_type' = {model_type!r} must be one of {sorted(MODEL_MODULES)}")
    return model_type


# each family registers its step contract (`family.ModelFamily`) when imported: any model object implies
# this package ran, so the runtime finds the family of every model it is given
from . import deepseek_v4_family  # noqa: E402
from .deepseek_v41 import family as deepseek_v41_family  # noqa: E402

__all__ = [
    "MODEL_MODULES",
    "check_checkpoint_context_parallel",
    "deepseek_v41_family",
    "deepseek_v4_family",
    "load_model",
]
