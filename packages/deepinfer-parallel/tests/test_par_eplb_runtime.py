"""EPLB at run time: the step schedule, the shuffle's sender/receiver pairing, and a rebalance with
weight shuffle in the middle of a 4-rank EP run that leaves the outputs unchanged."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from deepinfer_parallel import EplbConfig, EplbState, RedundantExpertLayout, dispatch_combine  # noqa: E402
from deepinfer_parallel.eplb import transfer_plan  # noqa: E402
from deepinfer_parallel.launch import run_distributed  # noqa: E402
from par_moe_reference import E, H, assert_close, make_weights, model_reference, route, swiglu  # noqa: E402


def test_schedule_first_after_quarter_period_then_every_interval():
    layout = RedundantExpertLayout(4, 0, 1, num_layers=1)
    state = EplbState(layout, EplbConfig(interval=8, window=4))
    fired = [s for s in range(1, 30) if state.step(is_prompt=False) is not None]
    assert fired == [2, 10, 18, 26]  # counter starts at 8 - 8//4 = 6


def test_disabled_and_prefill_handling():
    layout = RedundantExpertLayout(4, 0, 1)
    state = EplbState(layout, EplbConfig(interval=0))
    assert all(state.step() is None for _ in range(20)) and state.filled == 0
    # NORMAL engine: prefill steps neither fill the window nor advance the counter.
    state = EplbState(layout, EplbConfig(interval=8, window=8))
    state.expert_count += 3
    assert state.step(is_prompt=True) is None and state.filled == 0 and state.counter == 6
    assert int(state.expert_count.sum()) == 0, "counts are cleared every step"
    # With rearrange_after_prefill, a prefill schedules a rebalance on the next decode step.
    state = EplbState(layout, EplbConfig(interval=100, window=8, rearrange_after_prefill=True))
    state.expert_count += 1
    assert state.step(is_prompt=True) is None and state.filled == 1
    assert state.step(is_prompt=True) is None
    assert state.step(is_prompt=False) is not None


def test_window_keeps_last_steps_as_logical_counts():
    layout = RedundantExpertLayout(4, 4, 2)  # rank 0 holds slots 0..3 = experts 0..3
    state = EplbState(layout, EplbConfig(interval=1000, window=3))
    for s in range(5):
        state.expert_count[0] = torch.tensor([s, 0, 0, 1])
        state.step()
    tokens = state.window_tokens()
    assert tokens[:, 0, 0].tolist() == [2, 3, 4] and tokens[:, 0, 3].tolist() == [1, 1, 1]


def test_bad_eplb_config():
    with pytest.raises(ValueError, match="EPLB window must be in \\[1, interval=4\\], got 8"):
        EplbConfig(interval=4, window=8)
    with pytest.raises(ValueError, match="EPLB interval must be >= 0"):
        EplbConfig(interval=-1)


def test_transfer_pairing_rule():
    # 4 ranks, 2 slots each. Expert 0 held by ranks 0 and 1; needed by ranks 0, 1, 2, 3 afterwards.
    old = [0, 1, 0, 2, 3, 4, 5, 6]
    new = [0, 1, 0, 2, 0, 4, 0, 6]
    moves = [(t.expert, t.src, t.dst) for t in transfer_plan(old, new, 4)]
    # receivers [2, 3], senders [0, 1]: R//S = 1 -> receiver j uses sender j.
    assert moves == [(0, 0, 2), (0, 1, 3)]
    # 1 sender, 3 receivers: all from the sender.
    old = [7, 1, 2, 3, 4, 5, 6, 0]
    new = [7, 0, 0, 3, 0, 5, 6, 0]
    assert [(t.src, t.dst) for t in transfer_plan(old, new, 4)] == [(3, 0), (3, 1), (3, 2)]
    # 2 senders, 3 receivers: R//S = 1, first 2 receivers -> senders 0, 1; leftover -> sender 0.
    old = [0, 1, 0, 2, 3, 4, 5, 6, 7, 8]
    new = [0, 1, 0, 2, 0, 4, 0, 6, 0, 8]
    assert [(t.src, t.dst) for t in transfer_plan(old, new, 5)] == [(0, 2), (1, 3), (0, 4)]


LAYERS, REDUNDANT, BATCH = 2, 4, 12
HOT = (5, 6, 7)  # not the initially replicated experts 0..3: EPLB has to move replicas


def _load_local(layers, layout, rank):
    """Each rank's expert tensors [slots_per_rank, ...], loaded from the logical weights (as the loader)."""
    out = []
    for i, layer in enumerate(layers):
        local = layout.local_logical(i, rank)
        out.append([layer[name][local].clone() for name in ("w1", "w3", "w2")])
    return out


def _forward(x, layers, local_weights, layout, rank, state, group=None):
    for i, layer in enumerate(layers):
        w1, w3, w2 = local_weights[i]

        def local_expert_fn(slot, tokens, w1=w1, w3=w3, w2=w2):
            return swiglu(tokens, w1[slot], w3[slot], w2[slot])

        ids, weights = route(x, layer)
        routed = dispatch_combine(
            x, ids, weights, local_expert_fn, layout.layer(i), group, state.expert_count[i]
        )
        x = x + swiglu(x, layer["s1"], layer["s3"], layer["s2"]) + routed
    return x


def _eplb_worker(rank, world):
    layers = make_weights(LAYERS, seed=3, hot=HOT)
    layout = RedundantExpertLayout(E, REDUNDANT, world, num_layers=LAYERS)
    local_weights = _load_local(layers, layout, rank)
    state = EplbState(
        layout, EplbConfig(interval=8, window=2), expert_weights=local_weights, lb_stat_interval=2
    )
    x = torch.randn(BATCH, H, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    expected = model_reference(x, layers)
    old_map = layout.phys_to_logical.clone()
    outputs, reports, rows = [], [], []
    for _ in range(4):  # the first rebalance fires at step 2
        outputs.append(_forward(x, layers, local_weights, layout, rank, state))
        rows.append(state.expert_count.sum(1).double())  # rows this rank's experts ran, per layer
        reports.append(state.step(is_prompt=False))
    assert [r is not None for r in reports] == [False, True, False, False]
    for out in outputs:
        assert_close(out, expected)

    report = reports[1]
    new_map = layout.phys_to_logical
    assert report.layers_changed == sum(not torch.equal(old_map[i], new_map[i]) for i in range(LAYERS)) > 0
    assert report.imbalance_after < report.imbalance_before
    # Replicas moved to the hot experts.
    assert all(int(layout.replica_count[i, list(HOT)].sum()) > len(HOT) for i in range(LAYERS))
    # Each expert a rank newly needs crosses the network exactly once; nothing else moves.
    expert_bytes = sum(t[0].numel() * t.element_size() for t in local_weights[0])
    needed = 0
    for i in range(LAYERS):
        old = old_map[i].view(world, -1).numpy()
        new = new_map[i].view(world, -1).numpy()
        needed += sum(len(np.setdiff1d(np.unique(new[r]), old[r])) for r in range(world))
    assert report.bytes_moved_total == needed * expert_bytes > 0
    assert len(transfer_plan(old_map[0].numpy(), new_map[0].numpy(), world)) <= needed
    # Local tensors now hold exactly the logical experts the new map names.
    for i, layer in enumerate(layers):
        local = layout.local_logical(i, rank)
        assert torch.equal(local_weights[i][0], layer["w1"][local])
    # moe_lb = sum over (step, layer) of the max over ranks / the same sum of the mean.
    mine = torch.stack(rows)  # [steps, layers]
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    everyone = torch.stack(everyone)
    expected_lb = float(everyone.amax(0).sum() / everyone.mean(0).sum())
    assert abs(state.load_stats.moe_lb - expected_lb) < 1e-12 and expected_lb > 1.0
    sent = torch.tensor([report.shuffle.bytes_sent])
    dist.all_reduce(sent)
    assert int(sent) == report.bytes_moved_total


@pytest.mark.distributed
def test_rebalance_and_shuffle_mid_run_keep_outputs():
    run_distributed(_eplb_worker, 4)


def _subgroup_worker(rank, world):
    """Two EP groups of 2 ranks each in a world of 4 (dp=4, ep=2): collectives and P2P stay inside."""
    from deepinfer_parallel import init_parallel

    par = init_parallel(dp=4, cp=1, ep=2)
    ep_rank, group = par.ep.rank_in_group, par.ep.group
    layers = make_weights(LAYERS, seed=4, hot=HOT)
    layout = RedundantExpertLayout(E, 2, 2, num_layers=LAYERS)
    local_weights = _load_local(layers, layout, ep_rank)
    state = EplbState(layout, EplbConfig(interval=4, window=1), expert_weights=local_weights, group=group)
    x = torch.randn(6 + rank, H, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    expected = model_reference(x, layers)
    reports = []
    for _ in range(2):  # rebalance at step 1
        assert_close(_forward(x, layers, local_weights, layout, ep_rank, state, group), expected)
        reports.append(state.step())
    assert reports[0] is not None and reports[0].bytes_moved_total > 0
    for i, layer in enumerate(layers):
        assert torch.equal(local_weights[i][0], layer["w1"][layout.local_logical(i, ep_rank)])


@pytest.mark.distributed
def test_eplb_in_ep_subgroups():
    run_distributed(_subgroup_worker, 4)


def test_config_from_env(monkeypatch):
    monkeypatch.setenv("DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL", "50")
    monkeypatch.setenv("DEEPINFER_EXPERT_COUNT_WINDOW_SIZE", "100")
    monkeypatch.setenv("DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE", "1")
    monkeypatch.setenv("DEEPINFER_REARRANGE_P2P_GROUPS", "4")
    cfg = EplbConfig.from_env()
    assert (cfg.interval, cfg.window, cfg.rearrange_after_prefill, cfg.p2p_groups) == (50, 50, True, 4)
    monkeypatch.setenv("DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE", "false")
    monkeypatch.setenv("DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL", "x")
    with pytest.raises(ValueError, match="DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL must be an integer"):
        EplbConfig.from_env()
