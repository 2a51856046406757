"""deepinfer-model: the DeepSeek-V4 family (public V4 and V4.1) for DeepInfer."""

from .config import ConfigError, ModelConfig, load_config, parse_config
from .loader import CheckpointError
from .models import load_model
from .models.deepseek_v4 import DeepseekV4Model

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeepseekV4Model",
    "ModelConfig",
    "load_config",
    "load_model",
    "parse_config",
]
