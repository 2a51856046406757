"""DeepSeek-V4.1 `config.json` parsing and validation (spec v41-model §1.1–§1.3).

The HF file has a top-level part (architecture, dtype, quantisation, vision) and a `text_config`
holding the text model. `DeepseekV41Config.from_dict` checks every documented hard rule and raises a
`ValueError` that names the key, the value found and the rule; the cross-layer topology (§1.5) is
derived and validated in `topology.py` and attached as `config.topology`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import CSA, MOE, SLIDING, AttentionSpec, ModelConfig, QuantConfig, RopeSpec, YarnScaling
from .topology import Topology, build_topology
from .vision.config import VisionConfig, parse_vision_config

ARCHITECTURE = "DeepseekV41ForCausalLM"
MODEL_TYPE = "deepseek_v41"

_QUANT_RULES = {
    "quant_method": "fp8",
    "expert_dtype": "fp4",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
}


def _bad(key: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"config key {key!r} = {value!r}: {rule}")


def _need(d: dict, key: str, prefix: str = "text_config.") -> Any:
    if key not in d:
        raise ValueError(f"config key {prefix + key!r} is missing: it is required for {MODEL_TYPE}")
    return d[key]


def _pos_int(d: dict, key: str, prefix: str = "text_config.", allow_zero: bool = False) -> int:
    v = _need(d, key, prefix)
    lo = 0 if allow_zero else 1
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(prefix + key, v, f"must be an integer >= {lo}")
    return v


def _pos_float(d: dict, key: str, prefix: str = "text_config.") -> float:
    v = _need(d, key, prefix)
    if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
        raise _bad(prefix + key, v, "must be a number > 0")
    return float(v)


def _id_list(d: dict, key: str, default: Any = None) -> list[int]:
    v = d.get(key, default)
    if v is None:
        return []
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise _bad("text_config." + key, v, "must be a list of integer layer ids")
    return list(v)


@dataclass(frozen=True)
class EngramConfig:
    """Derived Engram settings (§5): tables for n-gram sizes 2..max_ngram_size."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    vocab_size: int
    n_heads: int
    head_dim: int
    pad_token_id: int


@dataclass(frozen=True)
class DSparkConfig:
    """Drafter settings (§7); the MoE of draft blocks overrides only the expert counts."""

    num_blocks: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    noise_token_id: int
    pad_token_id: int | None
    n_routed_experts: int
    num_experts_per_tok: int


@dataclass(frozen=True, kw_only=True)
class DeepseekV41Config(ModelConfig):
    """The internal V4.1 config: the shared `ModelConfig` plus the V4.1-only parts (§1.3)."""

    compress_ratios: tuple[int, ...]  # backbone layers only (draft entries dropped, §1.2)
    use_fp4_sparse_kv: bool
    engram: EngramConfig | None
    dspark: DSparkConfig | None
    topology: Topology
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    hc_post_mult: float = 2.0  # fixed by the reference (`hc_post_mult_value`, §1.3)
    vision: VisionConfig | None = None  # the vision tower, when `vision_config` describes one

    @property
    def n_prefill_layer(self) -> int:
        return self.topology.n_prefill_layer

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV41Config:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict, *, yoco_compaction: bool = True) -> DeepseekV41Config:
        """Parse and validate an HF V4.1 config dict.

        `yoco_compaction` enables the §1.5 rule 8 checks that only matter when prompt truncation is
        on (Engram in the producer half, drafter targets on one side); the reference checks them at
        model init, so they are on by default.
        """
        _check_top_level(cfg)
        t = cfg["text_config"]
        _check_text_rules(t)
        L = _pos_int(t, "num_hidden_layers")
        nextn = t.get("num_nextn_predict_layers", 0)
        if isinstance(nextn, bool) or not isinstance(nextn, int) or nextn < 0:
            raise _bad("text_config.num_nextn_predict_layers", nextn, "must be an integer >= 0")
        ratios = _need(t, "compress_ratios")
        if not isinstance(ratios, list) or len(ratios) != L + nextn:
            raise _bad(
                "text_config.compress_ratios",
                ratios,
                f"must be a list of num_hidden_layers + num_nextn_predict_layers = {L + nextn} entries",
            )
        for i, r in enumerate(ratios):
            if r not in (0, 1, 2) or isinstance(r, bool):
                raise _bad(
                    f"text_config.compress_ratios[{i}]", r, "each ratio must be 0 (SWA), 1 (C1) or 2 (C2)"
                )

        nh = _pos_int(t, "num_attention_heads")
        D = _pos_int(t, "head_dim")
        R = _pos_int(t, "qk_rope_head_dim")
        if R % 2 or R >= D:
            raise _bad("text_config.qk_rope_head_dim", R, f"must be even and < head_dim = {D}")
        G = _pos_int(t, "o_groups")
        if nh % G:
            raise _bad("text_config.o_groups", G, f"must divide num_attention_heads = {nh}")
        q_lora = t.get("q_lora_rank")
        if q_lora is None:
            raise _bad("text_config.q_lora_rank", q_lora, "is required (non-null) for V4.1")
        q_lora = _pos_int(t, "q_lora_rank")
        index_head_dim = _pos_int(t, "index_head_dim")
        if index_head_dim <= R:
            raise _bad("text_config.index_head_dim", index_head_dim, f"must be > qk_rope_head_dim = {R}")
        hc_mult = _pos_int(t, "hc_mult")
        W = _pos_int(t, "sliding_window")

        rope_scaling = None
        rs = t.get("rope_scaling")
        if rs is not None:
            if not isinstance(rs, dict):
                raise _bad("text_config.rope_scaling", rs, "must be an object or null")
            rope_scaling = YarnScaling(
                factor=_pos_float(rs, "factor", "text_config.rope_scaling."),
                original_max_position_embeddings=_pos_int(
                    rs, "original_max_position_embeddings", "text_config.rope_scaling."
                ),
                beta_fast=_pos_float(rs, "beta_fast", "text_config.rope_scaling."),
                beta_slow=_pos_float(rs, "beta_slow", "text_config.rope_scaling."),
            )

        engram = _parse_engram(t, L, hc_mult)
        dspark = _parse_dspark(t, cfg, L, nextn)
        topology = build_topology(
            t,
            ratios[:L],
            engram_layer_ids=engram.layer_ids if engram else (),
            dspark_target_layer_ids=dspark.target_layer_ids if dspark else (),
            yoco_compaction=yoco_compaction,
        )
        rope = RopeSpec(_pos_float(t, "rope_theta"), R, None)
        c_rope = RopeSpec(_pos_float(t, "compress_rope_theta"), R, rope_scaling)
        attention = tuple(
            AttentionSpec(SLIDING, 0, False, False, False, rope)
            if r == 0
            else AttentionSpec(CSA, r, False, False, topology.is_index_source(i), c_rope)
            for i, r in enumerate(ratios[:L])
        )
        return cls(
            vocab_size=_pos_int(t, "vocab_size"),
            hidden_size=_pos_int(t, "hidden_size"),
            num_hidden_layers=L,
            num_attention_heads=nh,
            head_dim=D,
            qk_rope_head_dim=R,
            q_lora_rank=q_lora,
            o_lora_rank=_pos_int(t, "o_lora_rank"),
            o_groups=G,
            rms_norm_eps=_pos_float(t, "rms_norm_eps"),
            max_position_embeddings=_pos_int(t, "max_position_embeddings"),
            rope_theta=rope.theta,
            compress_rope_theta=c_rope.theta,
            rope_scaling=rope_scaling,
            sliding_window=W,
            attention=attention,
            mlp_layer_types=(MOE,) * L,
            index_topk=_pos_int(t, "index_topk"),
            index_n_heads=_pos_int(t, "index_n_heads"),
            index_head_dim=index_head_dim,
            hc_mult=hc_mult,
            hc_eps=_pos_float(t, "hc_eps"),
            hc_sinkhorn_iters=_pos_int(t, "hc_sinkhorn_iters"),
            hc_shifted=_shifted(t),
            moe_intermediate_size=_pos_int(t, "moe_intermediate_size"),
            n_routed_experts=_pos_int(t, "n_routed_experts"),
            n_shared_experts=_pos_int(t, "n_shared_experts"),
            num_experts_per_tok=_experts_per_tok(t),
            routed_scaling_factor=_pos_float(t, "routed_scaling_factor"),
            swiglu_limit=_pos_float(t, "swiglu_limit"),
            q_head_norm=False,  # V4.1 has no per-head q RMSNorm
            index_score_scale=False,  # V4.1 index logits are unscaled
            quant=QuantConfig(weight_block_size=(32, 32), expert_dtype="fp4", scale_fmt="ue8m0"),
            num_nextn_predict_layers=nextn,
            model_type=MODEL_TYPE,
            extra=cfg,
            compress_ratios=tuple(ratios[:L]),
            use_fp4_sparse_kv=bool(t.get("use_fp4_sparse_kv", True)),
            engram=engram,
            dspark=dspark,
            topology=topology,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            vision=parse_vision_config(cfg),
        )


def _check_top_level(cfg: dict) -> None:
    if not isinstance(cfg, dict):
        raise ValueError(f"config must be a JSON object, got {type(cfg).__name__}")
    arch = _need(cfg, "architectures", "")
    if not isinstance(arch, list) or len(arch) != 1 or arch[0] != ARCHITECTURE:
        raise _bad("architectures", arch, f"must be exactly [{ARCHITECTURE!r}]")
    if cfg.get("model_type") != MODEL_TYPE:
        raise _bad("model_type", cfg.get("model_type"), f"must be {MODEL_TYPE!r}")
    if cfg.get("dtype") != "bfloat16":
        raise _bad("dtype", cfg.get("dtype"), "must be 'bfloat16'")
    q = _need(cfg, "quantization_config", "")
    if not isinstance(q, dict):
        raise _bad("quantization_config", q, "must be an object")
    for key, want in _QUANT_RULES.items():
        got = q.get(key)
        if isinstance(want, list):
            got = list(got) if isinstance(got, list | tuple) else got
        if got != want:
            raise _bad(f"quantization_config.{key}", q.get(key), f"must be {want!r}")
    if not isinstance(cfg.get("text_config"), dict):
        raise _bad("text_config", cfg.get("text_config"), "must be an object holding the text model")


def _check_text_rules(t: dict) -> None:
    for key, want in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("attention_dropout", 0.0),
        ("num_key_value_heads", 1),
    ):
        if t.get(key) != want or (want is False and t.get(key) is not False):
            raise _bad("text_config." + key, t.get(key), f"must be {want!r}")
    for key, want in (
        ("scoring_func", "sqrtsoftplus"),
        ("topk_method", "noaux_tc"),
        ("norm_topk_prob", True),
    ):
        if t.get(key) != want:
            raise _bad("text_config." + key, t.get(key), f"must be {want!r}")
    if t.get("tie_word_embeddings", False):
        raise _bad(
            "text_config.tie_word_embeddings",
            t["tie_word_embeddings"],
            "must be false: the checkpoint ships separate embed.weight and head.weight",
        )
    if t.get("dspark_target_attn_input", True) is not True:
        raise _bad(
            "text_config.dspark_target_attn_input",
            t["dspark_target_attn_input"],
            "must be true: drafter features are taken at the attention input",
        )


def _shifted(t: dict) -> bool:
    v = t.get("hc_shifted", True)
    if v is not True:
        raise _bad(
            "text_config.hc_shifted", v, "only the shifted mHC schedule (true) is implemented for V4.1"
        )
    return True


def _experts_per_tok(t: dict) -> int:
    k = _pos_int(t, "num_experts_per_tok")
    if k > t.get("n_routed_experts", 0):
        raise _bad("text_config.num_experts_per_tok", k, "must be <= n_routed_experts")
    return k


def _parse_engram(t: dict, L: int, hc_mult: int) -> EngramConfig | None:
    ids = _id_list(t, "engram_layer_ids")
    if not ids:
        return None
    for i in ids:
        if not 0 <= i < L:
            raise _bad("text_config.engram_layer_ids", ids, f"layer ids must lie in [0, {L})")
    if len(set(ids)) != len(ids):
        raise _bad("text_config.engram_layer_ids", ids, "layer ids must be distinct")
    if hc_mult <= 1:
        raise _bad("text_config.hc_mult", hc_mult, "Engram needs hc_mult > 1")
    if not t.get("engram_compressed_vocab_size"):
        raise _bad(
            "text_config.engram_compressed_vocab_size",
            t.get("engram_compressed_vocab_size"),
            "must be set (tokenizer compression is mandatory for Engram)",
        )
    n = _pos_int(t, "engram_max_ngram_size")
    if n < 2:
        raise _bad("text_config.engram_max_ngram_size", n, "must be >= 2 (tables for n-gram sizes 2..N)")
    return EngramConfig(
        layer_ids=tuple(ids),
        max_ngram_size=n,
        vocab_size=_pos_int(t, "engram_vocab_size"),
        n_heads=_pos_int(t, "engram_n_heads"),
        head_dim=_pos_int(t, "engram_head_dim"),
        pad_token_id=int(t.get("engram_pad_token_id", 2)),
    )


def _parse_dspark(t: dict, cfg: dict, L: int, nextn: int) -> DSparkConfig | None:
    if nextn == 0:
        return None
    targets = _id_list(t, "dspark_target_layer_ids")
    if not targets:
        raise _bad(
            "text_config.dspark_target_layer_ids",
            targets,
            "must list at least one backbone layer when num_nextn_predict_layers > 0",
        )
    for i in targets:
        if not 0 <= i < L:
            raise _bad("text_config.dspark_target_layer_ids", targets, f"layer ids must lie in [0, {L})")
    markov = _need(t, "dspark_markov_rank")
    if isinstance(markov, bool) or not isinstance(markov, int) or markov <= 0:
        raise _bad("text_config.dspark_markov_rank", markov, "must be an integer > 0")
    n_exp = _pos_int(t, "dspark_n_routed_experts")
    k = _pos_int(t, "dspark_num_experts_per_tok")
    if k > n_exp:
        raise _bad("text_config.dspark_num_experts_per_tok", k, "must be <= dspark_n_routed_experts")
    noise = _need(t, "dspark_noise_token_id")
    if isinstance(noise, bool) or not isinstance(noise, int) or not 0 <= noise < t.get("vocab_size", 0):
        raise _bad("text_config.dspark_noise_token_id", noise, "must be a token id in [0, vocab_size)")
    return DSparkConfig(
        num_blocks=nextn,
        block_size=_pos_int(t, "dspark_block_size"),
        target_layer_ids=tuple(targets),
        markov_rank=markov,
        noise_token_id=noise,
        pad_token_id=cfg.get("pad_token_id"),
        n_routed_experts=n_exp,
        num_experts_per_tok=k,
    )
