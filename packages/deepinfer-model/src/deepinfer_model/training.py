"""What a training recipe of a DeepSeek-V4.1 model reaches below the inference API, in one public module.

Training runs the same module code the engine serves (so a trained checkpoint is exactly what it loads), but it
needs pieces inference keeps inside the model: the layer functions that auxiliary losses re-run (the indexer's
scores, the router's logits, the attention's visibility), the storage formats of the checkpoint (FP8 block and
MXFP4 quantisation, the tensor layout and its dtypes), and the drafter's row forward. Naming them here keeps the
rest of `deepinfer_model` private to it: a recipe imports this module, never the modules behind it.
"""

from __future__ import annotations

from . import numerics
from .layers.attention import compressed_visible, project_query
from .layers.indexer import index_queries, index_scores
from .layers.rope import cos_sin
from .layers.router import router_logits, sqrt_softplus
from .loader import INDEX_FILE, load_tensors
from .models.deepseek_v41 import (
    CompressedVocabulary,
    DeepseekV41Config,
    DeepseekV41ForCausalLM,
    V41Weights,
    checkpoint_layout,
    quantised_v41_tensors,
    random_v41_tensors,
)
from .models.deepseek_v41.attention import AttentionTrace
from .models.deepseek_v41.blocks import moe_ffn
from .models.deepseek_v41.drafter import draft_rows, key_layout, main_keys
from .models.deepseek_v41.drafter_heads import confidence
from .models.deepseek_v41.kv_quant import EXACT_KV
from .models.deepseek_v41.layout import BF16, F32, FP4, FP8, FP8_ROWS
from .models.deepseek_v41.loader import ignored_prefixes
from .models.deepseek_v41.sparse import index_keys
from .numerics import linear, round_to
from .quant import (
    E4M3_MAX,
    dequant_fp8_block,
    dequant_mxfp4,
    fake_quant_fp4,
    pow2_ceil,
    quant_fp8_block,
    quant_mxfp4,
)

__all__ = [
    "BF16",
    "E4M3_MAX",
    "EXACT_KV",
    "F32",
    "FP4",
    "FP8",
    "FP8_ROWS",
    "INDEX_FILE",
    "AttentionTrace",
    "CompressedVocabulary",
    "DeepseekV41Config",
    "DeepseekV41ForCausalLM",
    "V41Weights",
    "checkpoint_layout",
    "compressed_visible",
    "confidence",
    "cos_sin",
    "dequant_fp8_block",
    "dequant_mxfp4",
    "draft_rows",
    "fake_quant_fp4",
    "ignored_prefixes",
    "index_keys",
    "index_queries",
    "index_scores",
    "key_layout",
    "linear",
    "load_tensors",
    "main_keys",
    "moe_ffn",
    "numerics",
    "pow2_ceil",
    "project_query",
    "quant_fp8_block",
    "quant_mxfp4",
    "quantised_v41_tensors",
    "random_v41_tensors",
    "round_to",
    "router_logits",
    "sqrt_softplus",
]
