"""V4.1 config parsing and every §1.5 topology rule: the §11 config is accepted, each violation fails
with an error naming the key and the rule."""

import pytest
from deepinfer_model.models.deepseek_v41 import DeepseekV41Config, tiny_v41_config_dict


def _cfg(**text):
    d = tiny_v41_config_dict()
    d["text_config"].update(text)
    return d


def _fails(d, *needles):
    with pytest.raises(ValueError) as e:
        DeepseekV41Config.from_dict(d)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_tiny_config_derivations():
    c = DeepseekV41Config.from_dict(tiny_v41_config_dict())
    t = c.topology
    assert c.kv_lora_rank == 64 and c.n_prefill_layer == 3 and t.yoco_enabled
    assert t.kv_source == (None, 1, 1, 3, 3, 5)
    assert t.index_k_source == (None, 1, 1, 3, 3, 5)
    assert t.index_source == (None, 1, 2, 3, 3, 5)
    assert t.candidate_source == 3 and [t.restricted_to_candidates(i) for i in range(6)] == [0, 0, 0, 0, 0, 1]
    assert [t.is_consumer_half(i) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    assert c.compress_ratios == (0, 2, 2, 1, 1, 1)  # draft entries dropped
    assert (
        c.engram.layer_ids == (1,) and c.dspark.target_layer_ids == (3, 5) and c.num_nextn_predict_layers == 2
    )


def test_index_k_defaults_to_kv_list():
    d = _cfg()
    del d["text_config"]["index_k_source_layer_ids"]
    assert DeepseekV41Config.from_dict(d).topology.index_k_source == (None, 1, 1, 3, 3, 5)


@pytest.mark.parametrize(
    "top,value,needle",
    [
        ("architectures", ["DeepseekV4ForCausalLM"], "architectures"),
        ("model_type", "deepseek_v4", "model_type"),
        ("dtype", "float16", "dtype"),
    ],
)
def test_top_level_rules(top, value, needle):
    d = _cfg()
    d[top] = value
    _fails(d, needle)


@pytest.mark.parametrize(
    "key,value",
    [
        ("quant_method", "int8"),
        ("expert_dtype", "fp8"),
        ("activation_scheme", "static"),
        ("weight_block_size", [128, 128]),
        ("scale_fmt", "e4m3"),
    ],
)
def test_quantisation_rules(key, value):
    d = _cfg()
    d["quantization_config"][key] = value
    _fails(d, f"quantization_config.{key}", repr(value))


@pytest.mark.parametrize(
    "key,value",
    [
        ("hidden_act", "gelu"),
        ("attention_bias", True),
        ("attention_dropout", 0.1),
        ("num_key_value_heads", 2),
        ("scoring_func", "softmax"),
        ("topk_method", "greedy"),
        ("norm_topk_prob", False),
        ("o_groups", 3),
        ("qk_rope_head_dim", 128),
        ("q_lora_rank", None),
        ("hc_shifted", False),
        ("tie_word_embeddings", True),
        ("dspark_target_attn_input", False),
        ("dspark_markov_rank", 0),
        ("compress_ratios", [0, 2, 2, 1, 1, 1]),
        ("compress_ratios", [0, 4, 2, 1, 1, 1, 0, 0]),
        ("hidden_size", 0),
    ],
)
def test_text_rules(key, value):
    _fails(_cfg(**{key: value}), key)


def test_missing_key_is_named():
    d = _cfg()
    del d["text_config"]["kv_source_layer_ids"]
    _fails(d, "kv_source_layer_ids", "missing")
    d = _cfg()
    del d["text_config"]["candidate_source_layer_id"]
    _fails(d, "candidate_source_layer_id", "missing")


# One failing config per §1.5 rule (each otherwise valid).
TOPOLOGY_VIOLATIONS = {
    "no C1 layer: n_prefill_layer undefined": (
        dict(compress_ratios=[0, 2, 2, 2, 2, 2, 0, 0], candidate_source_layer_id=None),
        "must contain a 1",
    ),
    "rule 1: consumer must be compressed": (
        dict(compress_ratios=[0, 2, 0, 1, 1, 1, 0, 0], index_source_layer_ids=[1, 3, 5]),
        "SWA-only",
    ),
    "rule 1: consumer must share the source's ratio": (
        dict(compress_ratios=[0, 2, 2, 1, 2, 1, 0, 0], candidate_source_layer_id=None),
        "ratio",
    ),
    "rule 3: top-k segment crosses an index-K segment": (
        dict(index_source_layer_ids=[1, 3], index_k_source_layer_ids=[1, 3, 5]),
        "index-K segment",
    ),
    "rule 3: index-K segment crosses a KV segment": (
        dict(
            kv_source_layer_ids=[1, 3, 4], index_k_source_layer_ids=[1, 3], index_source_layer_ids=[1, 2, 3]
        ),
        "KV segment",
    ),
    "rule 4: KV sharing across the YOCO boundary": (
        dict(kv_source_layer_ids=[1, 5], index_k_source_layer_ids=[1, 5], index_source_layer_ids=[1, 5]),
        "YOCO boundary",
    ),
    "rule 5: draft layers never share": (dict(kv_source_layer_ids=[1, 3, 6]), "never share"),
    "source must be a compressed layer": (dict(kv_source_layer_ids=[0, 1, 3, 5]), "SWA-only"),
    "rule 6: candidate source must be an index source": (dict(candidate_source_layer_id=4), "index-source"),
    "rule 6: candidate source must be compressed": (dict(candidate_source_layer_id=0), "compressed"),
    "rule 6: topk_blocks multiple of 8": (dict(candidate_topk_blocks=12), "multiple of 8"),
    "rule 6: topk_blocks > 0": (dict(candidate_topk_blocks=0), "multiple of 8"),
    "rule 6: block size in {8, 16}": (dict(candidate_block_size=4), "candidate_block_size"),
    "rule 6: block size <= 16": (dict(candidate_block_size=32), "candidate_block_size"),
    "rule 6: same ratio after the candidate source": (dict(candidate_source_layer_id=1), "ratio"),
    "rule 6: capacity >= index_topk": (dict(index_topk=72), "capacity"),
    "rule 6: index_n_heads <= 32": (dict(index_n_heads=64), "index_n_heads"),
    "rule 6: index_head_dim == 128": (dict(index_head_dim=96), "index_head_dim"),
    "rule 6: topk_blocks <= 4096": (dict(candidate_topk_blocks=4104), "4096"),
    "rule 8: Engram in the producer half": (dict(engram_layer_ids=[4]), "producer half"),
    "rule 8: drafter targets on one side": (dict(dspark_target_layer_ids=[1, 5]), "one side"),
    "duplicate source ids": (dict(index_source_layer_ids=[1, 1, 3, 5]), "distinct"),
    "empty source list": (dict(index_source_layer_ids=[]), "non-empty"),
    "Engram layer out of range": (dict(engram_layer_ids=[6]), "engram_layer_ids"),
    "drafter target out of range": (dict(dspark_target_layer_ids=[7]), "dspark_target_layer_ids"),
}


@pytest.mark.parametrize("name", sorted(TOPOLOGY_VIOLATIONS))
def test_topology_rule_violation_fails(name):
    changes, needle = TOPOLOGY_VIOLATIONS[name]
    _fails(_cfg(**changes), needle)


def test_rule8_only_with_compaction():
    d = _cfg(engram_layer_ids=[4])
    c = DeepseekV41Config.from_dict(d, yoco_compaction=False)
    assert c.engram.layer_ids == (4,)


def test_candidate_disabled_and_yoco_off():
    # No candidate blocks; the only C1 entry is a draft-block entry, so YOCO is off.
    c = DeepseekV41Config.from_dict(
        _cfg(
            compress_ratios=[0, 2, 2, 2, 2, 2, 1, 0],
            candidate_source_layer_id=None,
            kv_source_layer_ids=[1, 3],
            index_k_source_layer_ids=[1, 3],
            index_source_layer_ids=[1, 3],
            dspark_target_layer_ids=[3, 5],
        )
    )
    assert c.n_prefill_layer == 6 and not c.topology.yoco_enabled and c.topology.candidate_source is None
