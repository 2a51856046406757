"""YOCO truncation without weights (L1): plan, metadata, KEEP condition, settings, FLOP estimate.

The L1 property: for any prompt length, chunking and KEEP >= W + B, the compact metadata equals the mask
metadata on the kept rows, the kept rows are exactly the rule's suffix, every visible SWA key of every
chunk is in the simulated ring or computed in the chunk, and a resume up to B tokens back finds its keys.
"""

import pytest
import torch
from deepinfer_model.models.deepseek_v41 import DeepseekV41Config, tiny_v41_config_dict
from deepinfer_model.models.deepseek_v41.yoco import (
    YocoMode,
    YocoSettings,
    _per_row_dense,
    check_keep,
    check_prompt_logprobs,
    check_settings,
    chunk_plan,
    max_backtracking,
    prefill_flops,
    swa_metadata,
)
from deepinfer_model.models.deepseek_v41.yoco_check import l1_check, l1_prefix_hit_check
from hypothesis import given, settings
from hypothesis import strategies as st


@st.composite
def prompts(draw):
    window = draw(st.integers(1, 24))
    backtracking = draw(st.integers(1, 8))
    keep = window + backtracking + draw(st.integers(0, 20))
    data_len = draw(st.integers(1, 160))
    chunks, left = [], data_len
    while left:
        n = draw(st.integers(1, left))
        chunks.append(n)
        left -= n
    return data_len, chunks, keep, window, backtracking


@settings(max_examples=150, deadline=None)
@given(prompts())
def test_l1_compact_equals_mask_on_kept_rows(p):
    data_len, chunks, keep, window, backtracking = p
    assert l1_check(data_len, chunks, keep, window, backtracking) == []


def test_l1_finds_a_missing_key_when_keep_is_too_small():
    """KEEP = W + B - 2: a resume B tokens back needs a key that was never replayed (the check is real)."""
    problems = l1_check(300, [100, 100, 100], 128 + 6 - 2, 128, 6)
    assert any("resume at data_len - 6" in p for p in problems)


def test_kept_rows_rule_examples():
    # Prompt 300, KEEP 140 -> rect_lo 160; chunks of 100.
    assert chunk_plan(300, 0, 100, 140, "compact").kept_rows.tolist() == [99]  # placeholder
    assert chunk_plan(300, 100, 100, 140, "compact").kept_positions.tolist() == list(range(160, 200))
    assert chunk_plan(300, 200, 100, 140, "compact").num_kept == 100
    assert chunk_plan(300, 0, 100, 140, "mask").num_kept == 100
    assert chunk_plan(100, 0, 100, 140, "compact").num_kept == 100  # prompt shorter than KEEP
    md = swa_metadata(chunk_plan(300, 0, 100, 140, "compact"), 128, 134)
    assert md.visible_positions(0) == [] and md.store_slot.tolist() == [-1]


def test_keep_condition_names_both_sides():
    check_keep(134, 128, 6)
    with pytest.raises(
        ValueError, match=r"KEEP = DEEPINFER_YOCO_PREFILL_KEEP_TOKENS = 133 .* 128 \+ 6 = 134"
    ):
        check_keep(133, 128, 6)
    assert max_backtracking(0, 5) == 6 and max_backtracking(10, 5) == 10
    cfg = DeepseekV41Config.from_dict(tiny_v41_config_dict())  # W = 8, YOCO boundary at layer 3
    check_settings(YocoSettings(YocoMode.COMPACT, 14), cfg, 6)
    with pytest.raises(ValueError, match="= 13 must be >= sliding_window W"):
        check_settings(YocoSettings(YocoMode.COMPACT, 13), cfg, 6)
    no_yoco = tiny_v41_config_dict()
    no_yoco["text_config"]["compress_ratios"] = [0, 2, 2, 2, 2, 2, 1, 0]  # first C1 past the backbone
    no_yoco["text_config"]["index_source_layer_ids"] = [1, 3, 5]
    with pytest.raises(ValueError, match="needs a YOCO model"):
        check_settings(YocoSettings(YocoMode.MASK, 140), DeepseekV41Config.from_dict(no_yoco), 6)


def test_settings_from_env():
    assert YocoSettings.from_env({}) == YocoSettings(YocoMode.OFF, 0)
    s = YocoSettings.from_env(
        {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "140"}
    )
    assert s == YocoSettings(YocoMode.COMPACT, 140) and s.enabled
    with pytest.raises(ValueError, match="TRUNCATION_MODE must be one of off, mask, compact, got 'fast'"):
        YocoSettings.from_env({"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "fast"})
    with pytest.raises(ValueError, match="KEEP_TOKENS = 0 must be > 0"):
        YocoSettings.from_env({"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "mask"})
    with pytest.raises(ValueError, match="must be an integer"):
        YocoSettings.from_env({"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "lots"})


def test_prompt_logprobs_refused_under_truncation():
    check_prompt_logprobs(YocoSettings(), True)
    check_prompt_logprobs(YocoSettings(YocoMode.COMPACT, 140), False)
    for mode in (YocoMode.MASK, YocoMode.COMPACT):
        with pytest.raises(ValueError, match="prompt_logprobs = True is not available"):
            check_prompt_logprobs(YocoSettings(mode, 140), True)


def _naive_flops(cfg, q_start, q_len, data_len, keep, mode):
    """Row-by-row sums over the metadata (the estimate's closed forms must reproduce them)."""
    D, nh, W = cfg.head_dim, cfg.num_attention_heads, cfg.sliding_window
    total = 0.0
    for layer in range(cfg.num_hidden_layers):
        consumer = layer >= cfg.n_prefill_layer
        plan = chunk_plan(data_len, q_start, q_len, keep if consumer else None, mode if consumer else "off")
        md = swa_metadata(plan, W, W + 6)
        r = cfg.compress_ratios[layer]
        for i, pos in enumerate(md.positions.tolist()):
            total += _per_row_dense(cfg, layer) + 4 * 2 * nh * D * len(md.visible_positions(i))
            if r:
                total += 4 * 2 * nh * D * min((pos + 1) // r, cfg.index_topk)
                if cfg.topology.is_index_source(layer):
                    total += cfg.index_n_heads * cfg.index_head_dim * ((pos + 1) // r)
        if r and cfg.topology.is_kv_source(layer):
            total += 2 * 2 * cfg.hidden_size * D * q_len
            if cfg.topology.is_index_k_source(layer):
                total += 2 * D * cfg.index_head_dim * ((q_start + q_len) // r - q_start // r)
    return total + 4 * cfg.hidden_size * cfg.vocab_size


@pytest.mark.parametrize(
    "q_start,q_len,data_len,keep,mode",
    [
        (0, 200, 200, 14, "off"),
        (0, 200, 200, 14, "compact"),
        (0, 200, 200, 20, "mask"),
        (37, 50, 300, 30, "compact"),
        (0, 37, 300, 30, "compact"),
        (150, 150, 300, 30, "mask"),
        (0, 5, 5, 14, "compact"),
    ],
)
def test_prefill_flops_closed_forms_match_row_sums(q_start, q_len, data_len, keep, mode):
    cfg = DeepseekV41Config.from_dict(tiny_v41_config_dict())
    est = prefill_flops(cfg, q_start, q_len, data_len, keep if mode != "off" else None, mode)
    assert est.total == pytest.approx(_naive_flops(cfg, q_start, q_len, data_len, keep, mode), rel=1e-12)


def test_compact_flops_skip_consumer_rows():
    cfg = DeepseekV41Config.from_dict(tiny_v41_config_dict())
    off = prefill_flops(cfg, 0, 4096, 4096)
    comp = prefill_flops(cfg, 0, 4096, 4096, 14, "compact")
    assert comp.consumer_rows == 14 and off.consumer_rows == 4096
    assert comp.producer == off.producer and comp.total < 0.75 * off.total
    # The consumer compressors still run over every row.
    assert comp.consumer > 14 / 4096 * off.consumer
    assert torch.tensor(comp.attention) < off.attention


@st.composite
def prefix_hits(draw):
    window, backtracking = draw(st.integers(1, 16)), draw(st.integers(1, 6))
    keep = window + backtracking + draw(st.integers(0, 10))
    len_a = draw(st.integers(2, 120))
    hit = draw(st.integers(max(1, len_a - backtracking), len_a))
    len_b = draw(st.integers(max(len_a, hit + 1), len_a + 80))
    cuts = lambda n: draw(st.lists(st.integers(1, 40), min_size=1).map(lambda xs: _fit(xs, n)))  # noqa: E731
    return len_a, cuts(len_a), hit, len_b, cuts(len_b - hit), keep, window, backtracking


def _fit(xs: list[int], n: int) -> list[int]:
    """Chunk lengths from `xs`, cut / extended to sum to n."""
    out = []
    for x in xs:
        if sum(out) + x >= n:
            break
        out.append(x)
    return out + [n - sum(out)]


@settings(max_examples=60, deadline=None)
@given(prefix_hits())
def test_l1_prefix_hit_resume_at_least_as_long(case):
    """A prompt B (len_b >= len_a) sharing a truncated prefill's first `hit >= len_a - B` tokens (prefix-cache
    hit or rollback) continues from that state's W + B slot SWA ring: every key it reads is there, none is
    stale, and B's own state again supports resumes up to B tokens back."""
    assert l1_prefix_hit_check(*case) == []


def test_l1_prefix_hit_into_a_shorter_prompt_is_detected():
    """B shorter than A: its rect_lo lies below A's, so it may need consumer SWA keys A never replayed."""
    deep = l1_prefix_hit_check(300, [300], 250, 260, [10], 134, 128, 6)  # query at 250 needs key 126 < 166
    assert any("key 126 not in the ring" in p for p in deep)
    # Deeper than B into a longer prompt: fine while the ring covers every replayed key (KEEP = W + B) ...
    assert l1_prefix_hit_check(300, [300], 250, 400, [150], 134, 128, 6) == []
    # ... but KEEP > W + B replays keys the ring cannot hold: such a hit needs a saved state at that point.
    assert any("not in the ring" in p for p in l1_prefix_hit_check(300, [300], 200, 300, [100], 140, 128, 6))
    shallow = l1_prefix_hit_check(300, [300], 296, 297, [1], 134, 128, 6)  # B's own later back-off breaks
    assert any("prompt B: resume at data_len - 5" in p for p in shallow)
