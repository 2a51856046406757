"""Building blocks shared by the DeepSeek-V4 family (public V4 and V4.1).

Every block is a pure function over explicit tensors plus a small weights dataclass; none reads
global state. Math in FP64; `act_dtype` marks where the engine stores activations (FP32, or BF16 on real models).
"""

from .attention import (
    AttentionWeights,
    compressed_visible,
    project_latent,
    project_output,
    project_query,
    sink_attention,
    sliding_window_visible,
)
from .compressor import Compressed, CompressorWeights, compress
from .embedding import embed
from .engram import engram_gate
from .experts import ExpertWeights, MLPWeights, clamped_swiglu, experts_forward, mlp
from .indexer import IndexerWeights, index_queries, index_scores, select_topk, selection_mask
from .mhc import HCHeadParams, HCParams, expand, head_weights, mixes, read, sinkhorn, write
from .moe import MoEWeights, moe_block
from .norm import rms_norm
from .rope import apply_rope, cos_sin, inv_freq
from .router import route_hash, route_topk, sqrt_softplus

__all__ = [
    "AttentionWeights",
    "Compressed",
    "CompressorWeights",
    "ExpertWeights",
    "HCHeadParams",
    "HCParams",
    "IndexerWeights",
    "MLPWeights",
    "MoEWeights",
    "apply_rope",
    "clamped_swiglu",
    "compress",
    "compressed_visible",
    "cos_sin",
    "embed",
    "engram_gate",
    "expand",
    "head_weights",
    "index_queries",
    "index_scores",
    "inv_freq",
    "mixes",
    "mlp",
    "experts_forward",
    "moe_block",
    "project_latent",
    "project_output",
    "project_query",
    "read",
    "rms_norm",
    "route_hash",
    "route_topk",
    "select_topk",
    "selection_mask",
    "sink_attention",
    "sinkhorn",
    "sliding_window_visible",
    "sqrt_softplus",
    "write",
]
