"""deepinfer-model: the DeepSeek-V4 family (public V4 and V4.1) for DeepInfer."""

from .config import ConfigError, ModelConfig, load_config, parse_config
from .loader import CheckpointError
from .models import load_model
from .models.deepseek_v4 import DeepseekV4Model
from .models.deepseek_v41 import (
    DeepseekV41Config,
    DeepseekV41ForCausalLM,
    DraftOutput,
    V41Output,
    load_v41,
    make_v41_checkpoint,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeepseekV41Config",
    "DeepseekV41ForCausalLM",
    "DeepseekV4Model",
    "DraftOutput",
    "V41Output",
    "ModelConfig",
    "load_config",
    "load_model",
    "load_v41",
    "make_v41_checkpoint",
    "parse_config",
]
