"""DeepSeek-V4.1 (`model_type: deepseek_v41`): config, topology, Engram, DSpark drafter and model."""

from .config import DeepseekV41Config, DSparkConfig, EngramConfig, YarnScaling
from .tiny import tiny_v41_config_dict
from .topology import Topology, build_topology

__all__ = [
    "DSparkConfig",
    "DeepseekV41Config",
    "EngramConfig",
    "Topology",
    "YarnScaling",
    "build_topology",
    "tiny_v41_config_dict",
]
