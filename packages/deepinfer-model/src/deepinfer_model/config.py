"""DeepSeek-V4 configuration: parse `config.json` (HF or upstream keys), validate, derive one internal config.

`ModelConfig` is the single internal description every block reads. The V4.1 variant extends it
(subclass the dataclass and add its fields); blocks never read raw `config.json` dicts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"  # ratio-4 compression with overlapping windows + lightning indexer
HCA = "heavily_compressed_attention"  # large-ratio compression, dense over all complete blocks
ATTENTION_KINDS = (SLIDING, CSA, HCA)
MOE = "moe"
HASH_MOE = "hash_moe"
MLP_KINDS = (MOE, HASH_MOE)

# Upstream DeepSeek configs give one integer per layer; these are the only ratios the public V4 has.
_UPSTREAM_RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}


class ConfigError(ValueError):
    """An invalid model configuration; the message names the key, the value and the rule."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation (amplitude scale fixed to 1, as DeepSeek-V4 uses it)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class RopeSpec:
    """Interleaved RoPE on the trailing `dim` channels of a vector."""

    theta: float
    dim: int
    yarn: YarnScaling | None = None


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention does. `compress_ratio == 0` means sliding-window only."""

    kind: str
    compress_ratio: int
    overlap: bool  # compressor pools overlapping 2r windows (public V4 CSA)
    position_bias: bool  # learned per-slot gate bias (`ape`)
    has_indexer: bool  # sparse top-k over compressed entries (else dense over complete blocks)
    rope: RopeSpec


@dataclass(frozen=True)
class QuantConfig:
    """Block-scaled weight quantisation of a checkpoint (spec §9)."""

    weight_block_size: tuple[int, int] = (128, 128)
    expert_dtype: str = "fp8"  # "fp8" (block-scaled E4M3) or "fp4" (MXFP4, 1x32 UE8M0 blocks)
    scale_fmt: str = "ue8m0"


@dataclass(frozen=True)
class ModelConfig:
    """Internal DeepSeek-V4 config (one per model; shared by every block)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: YarnScaling | None
    sliding_window: int
    attention: tuple[AttentionSpec, ...]
    mlp_layer_types: tuple[str, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    hc_shifted: bool
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_limit: float
    q_head_norm: bool  # unweighted per-head RMSNorm after wq_b (public V4: yes; V4.1: no)
    index_score_scale: bool  # indexer multiplies by d_i^-1/2 * n_i^-1/2 (public V4: yes)
    quant: QuantConfig | None = None
    num_nextn_predict_layers: int = 0
    model_type: str = "deepseek_v4"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def kv_lora_rank(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def n_hash_layers(self) -> int:
        return sum(t == HASH_MOE for t in self.mlp_layer_types)

    def main_rope(self) -> RopeSpec:
        return RopeSpec(self.rope_theta, self.qk_rope_head_dim, None)

    def compress_rope(self) -> RopeSpec:
        return RopeSpec(self.compress_rope_theta, self.qk_rope_head_dim, self.rope_scaling)


# --------------------------------------------------------------------------------------------- parsing


def _get(cfg: dict, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise ConfigError(f"config key '{key}' is required")
        return default
    value = cfg[key]
    ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _as_tuple(kind))
    if not ok:
        names = "/".join(k.__name__ for k in _as_tuple(kind))
        raise ConfigError(f"config key '{key}' = {value!r} must be of type {names}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _positive(cfg: dict, key: str, default: Any = ...) -> int:
    value = _get(cfg, key, int, default)
    if value <= 0:
        raise ConfigError(f"config key '{key}' = {value!r} must be a positive integer")
    return value


def _non_negative(cfg: dict, key: str, default: Any = ...) -> int:
    value = _get(cfg, key, int, default)
    if value < 0:
        raise ConfigError(f"config key '{key}' = {value!r} must be a non-negative integer")
    return value


def _positive_float(cfg: dict, key: str, default: Any = ...) -> float:
    value = float(_get(cfg, key, (int, float), default))
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"config key '{key}' = {value!r} must be a positive finite number")
    return value


def _yarn(scaling: dict | None) -> YarnScaling | None:
    """`rope_scaling` / `rope_parameters` dict -> YaRN params; default rope -> None."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ConfigError(f"config key 'rope_scaling.type' = {rope_type!r} must be 'yarn' or 'default'")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise ConfigError(f"config key 'rope_scaling.{key}' is required for YaRN")
    attention_factor = scaling.get("attention_factor", 1.0)
    if attention_factor not in (None, 1, 1.0):
        raise ConfigError(f"config key 'rope_scaling.attention_factor' = {attention_factor!r} must be 1.0")
    yarn = YarnScaling(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
    )
    if yarn.factor <= 0 or yarn.original_max_position_embeddings <= 0:
        raise ConfigError(f"config key 'rope_scaling' = {scaling!r}: factor and original length must be > 0")
    return yarn


def _rope_fields(cfg: dict) -> tuple[float, float, YarnScaling | None]:
    """Both spellings: upstream `rope_theta` + `compress_rope_theta` + `rope_scaling`, or HF `rope_parameters`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("main"), dict):
        main, comp = params["main"], params.get("compress") or {}
        theta = float(main.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        ctheta = float(comp.get("rope_theta", cfg.get("compress_rope_theta", 160000.0)))
        return theta, ctheta, _yarn(comp)
    theta = _positive_float(cfg, "rope_theta", 10000.0)
    ctheta = _positive_float(cfg, "compress_rope_theta", 160000.0)
    scaling = cfg.get("rope_scaling")
    if scaling is None and isinstance(params, dict):
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return theta, ctheta, _yarn(scaling)


def _layer_kinds(cfg: dict, n_layers: int) -> tuple[list[str], list[int]]:
    """Per-layer attention kind and compression ratio from `layer_types` + `compress_rates` or `compress_ratios`."""
    if cfg.get("layer_types") is not None:
        kinds = list(_get(cfg, "layer_types", list))
        rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
        if "compress_rate_csa" in cfg:
            rates[CSA] = cfg["compress_rate_csa"]
        if "compress_rate_hca" in cfg:
            rates[HCA] = cfg["compress_rate_hca"]
        for k in (CSA, HCA):
            if not isinstance(rates.get(k), int) or rates[k] <= 0:
                raise ConfigError(
                    f"config key 'compress_rates.{k}' = {rates.get(k)!r} must be a positive integer"
                )
        if len(kinds) < n_layers:
            raise ConfigError(
                f"config key 'layer_types' has {len(kinds)} entries; needs num_hidden_layers = {n_layers}"
            )
        kinds = kinds[:n_layers]
        for i, k in enumerate(kinds):
            if k not in ATTENTION_KINDS:
                raise ConfigError(f"config key 'layer_types[{i}]' = {k!r} must be one of {ATTENTION_KINDS}")
        return kinds, [0 if k == SLIDING else rates[k] for k in kinds]
    ratios = _get(cfg, "compress_ratios", list)
    if len(ratios) < n_layers:
        raise ConfigError(
            f"config key 'compress_ratios' has {len(ratios)} entries; needs at least num_hidden_layers = {n_layers}"
        )
    ratios = ratios[:n_layers]  # upstream lists also carry entries for the MTP blocks
    for i, r in enumerate(ratios):
        if r not in _UPSTREAM_RATIO_KIND:
            raise ConfigError(f"config key 'compress_ratios[{i}]' = {r!r} must be one of 0, 4, 128")
    return [_UPSTREAM_RATIO_KIND[r] for r in ratios], list(ratios)


def _mlp_kinds(cfg: dict, n_layers: int) -> list[str]:
    if cfg.get("mlp_layer_types") is not None:
        kinds = list(_get(cfg, "mlp_layer_types", list))
        if len(kinds) < n_layers:
            raise ConfigError(
                f"config key 'mlp_layer_types' has {len(kinds)} entries; needs num_hidden_layers = {n_layers}"
            )
        kinds = kinds[:n_layers]
        for i, k in enumerate(kinds):
            if k not in MLP_KINDS:
                raise ConfigError(f"config key 'mlp_layer_types[{i}]' = {k!r} must be one of {MLP_KINDS}")
        return kinds
    n_hash = _get(cfg, "num_hash_layers", int, 3)
    if not 0 <= n_hash <= n_layers:
        raise ConfigError(
            f"config key 'num_hash_layers' = {n_hash} must be in [0, num_hidden_layers={n_layers}]"
        )
    return [HASH_MOE] * n_hash + [MOE] * (n_layers - n_hash)


def _quant(cfg: dict) -> QuantConfig | None:
    q = cfg.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise ConfigError(
            f"config key 'quantization_config.quant_method' = {q.get('quant_method')!r} must be 'fp8'"
        )
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(
            f"config key 'quantization_config.weight_block_size' = {block!r} must be two positive integers"
        )
    expert = q.get("expert_dtype", cfg.get("expert_dtype", "fp8")) or "fp8"
    if expert not in ("fp8", "fp4"):
        raise ConfigError(
            f"config key 'quantization_config.expert_dtype' = {expert!r} must be 'fp8' or 'fp4'"
        )
    fmt = q.get("scale_fmt", "ue8m0") or "ue8m0"
    if fmt not in ("ue8m0", "float"):
        raise ConfigError(f"config key 'quantization_config.scale_fmt' = {fmt!r} must be 'ue8m0' or 'float'")
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ConfigError(f"config key 'quantization_config.activation_scheme' = {act!r} must be 'dynamic'")
    return QuantConfig(weight_block_size=(block[0], block[1]), expert_dtype=expert, scale_fmt=fmt)


def parse_config(cfg: dict) -> ModelConfig:
    """Parse a public DeepSeek-V4 `config.json` dict (HF or upstream spelling) into a validated `ModelConfig`."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"config must be a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError(f"config key 'model_type' = {model_type!r} must be 'deepseek_v4'")
    for key, want in (("hidden_act", "silu"), ("scoring_func", "sqrtsoftplus")):
        if cfg.get(key, want) != want:
            raise ConfigError(f"config key '{key}' = {cfg[key]!r} must be {want!r}")
    if cfg.get("attention_bias", False):
        raise ConfigError("config key 'attention_bias' = True must be false")
    if cfg.get("num_key_value_heads", 1) != 1:
        raise ConfigError(
            f"config key 'num_key_value_heads' = {cfg['num_key_value_heads']!r} must be 1 (MQA)"
        )
    if cfg.get("tie_word_embeddings", False):
        raise ConfigError(
            "config key 'tie_word_embeddings' = True must be false (DeepSeek-V4 ships head.weight)"
        )
    if cfg.get("norm_topk_prob", True) is not True:
        raise ConfigError("config key 'norm_topk_prob' = False must be true")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"config key 'topk_method' = {cfg['topk_method']!r} must be 'noaux_tc'")

    n_layers = _positive(cfg, "num_hidden_layers")
    hidden = _positive(cfg, "hidden_size")
    heads = _positive(cfg, "num_attention_heads")
    head_dim = _positive(cfg, "head_dim")
    nested_main = (cfg.get("rope_parameters") or {}).get("main") or {}
    partial = cfg.get("partial_rotary_factor", nested_main.get("partial_rotary_factor"))
    if "qk_rope_head_dim" in cfg:
        rope_dim = _positive(cfg, "qk_rope_head_dim")
    elif partial is not None:
        rope_dim = int(head_dim * float(partial))
    else:
        rope_dim = 64
    if rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError(
            f"config key 'qk_rope_head_dim' = {rope_dim} must be even and <= head_dim = {head_dim}"
        )
    o_groups = _positive(cfg, "o_groups")
    if heads % o_groups:
        raise ConfigError(f"config key 'o_groups' = {o_groups} must divide num_attention_heads = {heads}")
    index_head_dim = _positive(cfg, "index_head_dim", 128)
    if rope_dim > index_head_dim:
        raise ConfigError(
            f"config key 'index_head_dim' = {index_head_dim} must be >= qk_rope_head_dim = {rope_dim}"
        )
    n_experts = _positive(cfg, "n_routed_experts")
    top_k = _positive(cfg, "num_experts_per_tok")
    if top_k > n_experts:
        raise ConfigError(
            f"config key 'num_experts_per_tok' = {top_k} must be <= n_routed_experts = {n_experts}"
        )
    hc_mult = _positive(cfg, "hc_mult", 4)
    theta, ctheta, yarn = _rope_fields(cfg)
    main_rope = RopeSpec(theta, rope_dim, None)
    comp_rope = RopeSpec(ctheta, rope_dim, yarn)

    kinds, ratios = _layer_kinds(cfg, n_layers)
    attention = tuple(
        AttentionSpec(
            kind=k,
            compress_ratio=r,
            overlap=k == CSA,
            position_bias=k != SLIDING,
            has_indexer=k == CSA,
            rope=main_rope if k == SLIDING else comp_rope,
        )
        for k, r in zip(kinds, ratios)
    )
    return ModelConfig(
        vocab_size=_positive(cfg, "vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=_positive(cfg, "q_lora_rank"),
        o_lora_rank=_positive(cfg, "o_lora_rank"),
        o_groups=o_groups,
        rms_norm_eps=_positive_float(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=_positive(cfg, "max_position_embeddings", 1 << 20),
        rope_theta=theta,
        compress_rope_theta=ctheta,
        rope_scaling=yarn,
        sliding_window=_positive(cfg, "sliding_window"),
        attention=attention,
        mlp_layer_types=tuple(_mlp_kinds(cfg, n_layers)),
        index_n_heads=_positive(cfg, "index_n_heads", 64),
        index_head_dim=index_head_dim,
        index_topk=_positive(cfg, "index_topk", 512),
        hc_mult=hc_mult,
        hc_eps=_positive_float(cfg, "hc_eps", 1e-6),
        hc_sinkhorn_iters=_positive(cfg, "hc_sinkhorn_iters", 20),
        hc_shifted=False,
        moe_intermediate_size=_positive(cfg, "moe_intermediate_size"),
        n_routed_experts=n_experts,
        n_shared_experts=_non_negative(cfg, "n_shared_experts", 1),
        num_experts_per_tok=top_k,
        routed_scaling_factor=_positive_float(cfg, "routed_scaling_factor", 1.0),
        swiglu_limit=_positive_float(cfg, "swiglu_limit", 10.0),
        q_head_norm=True,
        index_score_scale=True,
        quant=_quant(cfg),
        num_nextn_predict_layers=_get(cfg, "num_nextn_predict_layers", int, 0),
        model_type="deepseek_v4",
        extra=dict(cfg),
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or the file itself) and parse it."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no config.json at {file}")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from e
    return parse_config(raw)
