"""DeepSeek-V4.1 (`model_type: deepseek_v41`): config + topology, Engram, DSpark drafter, checkpoint I/O and
the stateless CPU reference forward.

    from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint
    make_v41_checkpoint("/tmp/v41")                      # §11 tiny config, random quantised weights
    model = load_v41("/tmp/v41")                         # or deepinfer_model.load_model("/tmp/v41")
    out = model.forward(token_ids, num_draft_tokens=4)   # out.logits [T, V]; out.draft.tokens/logits/confidence
"""

from .checkpoint import make_v41_checkpoint, quantised_v41_tensors
from .config import DeepseekV41Config, DSparkConfig, EngramConfig
from .drafter import DraftOutput
from .engram_hash import EngramLayout
from .engram_vocab import CompressedVocabulary
from .layout import checkpoint_layout
from .loader import load_model, load_v41
from .model import DeepseekV41ForCausalLM, V41Output
from .random_weights import random_v41_tensors
from .tiny import tiny_v41_config_dict
from .topology import Topology, build_topology
from .weights import V41Weights
from .yoco import YocoMode, YocoSettings, prefill_flops

__all__ = [
    "CompressedVocabulary",
    "DSparkConfig",
    "DeepseekV41Config",
    "DeepseekV41ForCausalLM",
    "DraftOutput",
    "EngramConfig",
    "EngramLayout",
    "Topology",
    "V41Output",
    "V41Weights",
    "YocoMode",
    "YocoSettings",
    "build_topology",
    "checkpoint_layout",
    "load_model",
    "load_v41",
    "make_v41_checkpoint",
    "prefill_flops",
    "quantised_v41_tensors",
    "random_v41_tensors",
    "tiny_v41_config_dict",
]
