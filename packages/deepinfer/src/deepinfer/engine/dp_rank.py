"""Inside one data-parallel rank (engine spec §3.1, §7.1, §7.3): the per-step vote that keeps the EP
group's all-to-alls matched (`DataParallelRank.agree`), the idle forwards, run-time EPLB, and the EP
model this rank loads (only its experts). The rank's `LLMEngine` holds a `DataParallelRank`; the rank
process that builds both is `rank_process.py`, the front that spawns the ranks `data_parallel.py`
(read its docstring for the whole picture).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger("deepinfer")


@dataclasses.dataclass
class EplbRunStats:
    """What the EPLB of one EP group did (the same on every rank of the group, except `seconds`)."""

    steps: int = 0  # EplbState.step calls: one per forward, real or idle
    prompt_steps: int = 0  # of which prefill steps (a prefill chunk on some rank of the group)
    rebalances: int = 0
    layers_changed: int = 0  # summed over the rebalances
    bytes_moved: int = 0  # expert weight bytes received over the EP group, summed over the rebalances
    seconds: float = 0.0  # time in rearrange() (plan + shuffle) on this rank
    # the last rebalance's planned peak / mean rank load on its window, old and new placement
    imbalance_before: float = 0.0
    imbalance_after: float = 0.0
    # measured moe_lb (sum over (step, layer) of the max over ranks / of the mean over ranks of the
    # routed rows): over the steps before the first rebalance (the initial placement), and over the
    # steps since (EPLB's placements; all-gathered every DEEPINFER_MOE_LB_STAT_INTERVAL steps)
    moe_lb_initial: float = 0.0
    moe_lb: float = 0.0

    def as_dict(self) -> dict:
        return {f"eplb_{k}": v for k, v in dataclasses.asdict(self).items()}


class ExpertCollectives:
    """The model's `moe_fn` on an EP rank: an `ExpertParallelMoE` plus a record of the MoE layers the
    current forward has entered, so that every forward, even one that failed before its last layer or
    had no tokens, joins every layer's all-to-all exactly once (`finish`).

    With `eplb` (a `deepinfer_parallel.EplbState` attached to the MoE), `finish` also runs the EPLB
    step of the forward: every forward of every EP rank, real or idle, ends there, so the ranks step
    in lockstep and a rebalance (a collective: counts all-reduced, weights shuffled in place) happens
    on all of them between the same two forwards. Under the async loop that is the worker thread,
    which runs the forwards one after the other, so no forward sees half-moved weights."""

    def __init__(self, moe, blocks: list, device: torch.device, eplb=None):
        self.moe, self.blocks, self.device = moe, blocks, device
        self.next_layer = 0
        self.eplb = eplb
        self.is_prompt = False  # this rank's part of the current forward has a prefill chunk
        self.eplb_stats = EplbRunStats()

    def __call__(self, layer: int, blk, y: torch.Tensor, *rest) -> torch.Tensor:
        self.next_layer = layer  # if this call fails before its dispatch, the layer is still owed
        out = self.moe(layer, blk, y, *rest)
        self.next_layer = layer + 1
        return out

    def begin(self, is_prompt: bool = False) -> None:
        self.next_layer = 0
        self.is_prompt = is_prompt

    def finish(self) -> None:
        """Join the all-to-alls of the layers the forward did not reach (none after a full forward),
        then the forward's EPLB step."""
        if self.next_layer > len(self.blocks):
            raise RuntimeError(f"a forward entered {self.next_layer} MoE layers of {len(self.blocks)}")
        self.moe.idle_step(self.blocks, start=self.next_layer)
        self.next_layer = 0
        if self.eplb is not None:
            self._eplb_step()

    def idle(self) -> None:
        """A forward without tokens (ExpertParallelMoE.idle_step): this rank has nothing scheduled."""
        self.begin()
        self.finish()

    def _eplb_step(self) -> None:
        # The ranks of a group batch different requests: one may prefill while another decodes or
        # idles. The forward counts as a prefill step (ignored by a NORMAL engine's EPLB unless
        # DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE) if any rank's part of it prefills;
        # agreeing on it keeps every rank's step counter, window and rebalance schedule identical,
        # which the rebalance's collectives need. On the device group, in order with the all-to-alls
        # (the gloo cpu_ep group belongs to the main thread's vote).
        flag = torch.tensor([int(self.is_prompt)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.moe.group)
        is_prompt = bool(flag.item())
        self.is_prompt = False
        report = self.eplb.step(is_prompt=is_prompt)
        st = self.eplb_stats
        st.steps += 1
        st.prompt_steps += int(is_prompt)
        lb = self.eplb.load_stats
        if report is not None:
            if st.rebalances == 0:
                # Every rank rebalanced at this step (same counters), so this gather is matched too:
                # the measured balance of the initial placement, then a fresh count for EPLB's.
                if lb.filled:
                    lb.flush()
                st.moe_lb_initial = lb.moe_lb
                lb.reset()
            st.rebalances += 1
            st.layers_changed += report.layers_changed
            st.bytes_moved += report.bytes_moved_total
            st.seconds += report.seconds
            st.imbalance_before, st.imbalance_after = report.imbalance_before, report.imbalance_after
        st.moe_lb = lb.moe_lb


class DraftCollectives:
    """The draft blocks' `draft_moe_fn` on an EP rank whose draft experts are sharded: an
    `ExpertParallelMoE` (part "drafter") plus the count of draft forwards this rank has entered, so that
    each step `DataParallelRank.agree_drafts` can bring every rank of the EP group to the same count with
    idle ones (ranks draft for different numbers of sequences and draft lengths, or not at all), and the
    layers a failed draft forward did not reach are still joined (`finish`)."""

    def __init__(self, moe, blocks: list):
        self.moe, self.blocks = moe, blocks
        self.forwards = 0
        self.next_layer = 0

    def __call__(self, layer: int, blk, y: torch.Tensor, *rest) -> torch.Tensor:
        if layer == 0:
            self.finish()  # a forward that failed part-way: its remaining all-to-alls come first
            self.forwards += 1
        self.next_layer = layer
        out = self.moe(layer, blk, y, *rest)
        self.next_layer = (layer + 1) % len(self.blocks)
        return out

    def finish(self) -> None:
        if self.next_layer:
            self.moe.idle_step(self.blocks, start=self.next_layer)
            self.next_layer = 0

    def idle(self) -> None:
        """A draft forward without tokens: every draft block's all-to-all joined."""
        self.forwards += 1
        self.moe.idle_step(self.blocks)


class DataParallelRank:
    """What one DP rank's `LLMEngine` needs: the EP model and the per-step vote (`agree`)."""

    def __init__(self, state, device: torch.device):
        self.state = state  # deepinfer_parallel.ParallelState
        self.rank, self.world = state.rank, state.sizes.world
        self.ep_size = state.ep.size
        self.device = device
        # With ep == 1 no collective couples the ranks' forwards: each runs on its own, no vote.
        self.vote_group = state.cpu_ep.group if self.ep_size > 1 else None
        self.collectives: ExpertCollectives | None = None
        self.draft_collectives: DraftCollectives | None = None  # with the draft experts sharded
        self.launched = 0  # forwards (real and idle) submitted to this rank's model so far
        self.messages = 0  # front messages (sent to every rank) this rank has taken in so far
        self.any_busy = False  # result of the last vote: does any rank of the EP group have work
        # this rank's context-parallel group holds front messages not all of its ranks have read yet
        # (rank_process.Inbox): the run goes on until they are applied
        self.held_messages = False
        self._idle_futures: deque[Future] = deque()
        self.step_trace = None  # the rank loop's StepTrace (rank_process.py), for benchmarks

    def load_model(self, path: Path, dtype: torch.dtype, device: torch.device):
        """This rank's model: whole with ep == 1, else the routed experts of its slots only."""
        from deepinfer_model import load_model

        if self.ep_size == 1:
            return load_model(path, dtype, device=device)
        import deepinfer_parallel as par
        from deepinfer_model import DeepseekV41Config, ExpertParallelMoE, load_v41_ep, shard_experts

        group, ep_rank = self.state.ep.group, self.state.ep.rank_in_group
        model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
        if model_type == "deepseek_v41":
            cfg = DeepseekV41Config.from_file(path)
            extra = par.num_redundant_experts(cfg.n_routed_experts, self.ep_size)
            layout = par.RedundantExpertLayout(
                cfg.n_routed_experts, extra, self.ep_size, cfg.num_hidden_layers, device=device
            )
            draft_layout = self._draft_layout(cfg, device)
            model = load_v41_ep(
                path, layout, group, act_dtype=dtype, draft_layout=draft_layout, device=device
            )
            moe, blocks = model.moe_fn, model.weights.layers
            if draft_layout is not None:
                self.draft_collectives = DraftCollectives(model.draft_moe_fn, model.weights.drafter.blocks)
                model.draft_moe_fn = self.draft_collectives
        else:  # the public V4: loaded whole, then cut to this rank's slots
            model = load_model(path, dtype, device=device)
            cfg = model.config
            extra = par.num_redundant_experts(cfg.n_routed_experts, self.ep_size)
            layout = par.RedundantExpertLayout(
                cfg.n_routed_experts, extra, self.ep_size, cfg.num_hidden_layers, device=device
            )
            shard_experts(model.layers, layout, ep_rank)
            moe, blocks = ExpertParallelMoE(cfg, layout, group, model.dtype), model.layers
        eplb = None
        config = par.EplbConfig.from_env(normal_engine=True)
        if config.interval > 0:  # run-time EPLB: counts from every dispatch, rebalance + in-place shuffle
            eplb = par.EplbState(layout, config, moe.expert_tensors(blocks), group=group)
            moe.attach_eplb(eplb)
        self.collectives = ExpertCollectives(moe, blocks, torch.device(device), eplb)
        model.moe_fn = self.collectives
        return model

    def _draft_layout(self, cfg, device):
        """The draft blocks' expert layout over the EP group, rounded as the reference rounds the draft
        head's MoE config on its own (its n_routed_experts, the same DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS
        minimum); None without draft blocks or with DEEPINFER_EP_SHARD_DRAFT_EXPERTS off (every rank then
        holds all draft experts and drafts without a collective)."""
        import deepinfer_parallel as par

        from .. import envs

        ds = cfg.dspark
        if ds is None or not envs.DEEPINFER_EP_SHARD_DRAFT_EXPERTS:
            return None
        extra = par.num_redundant_experts(ds.n_routed_experts, self.ep_size, which="drafter")
        return par.RedundantExpertLayout(
            ds.n_routed_experts, extra, self.ep_size, ds.num_blocks, device=device
        )

    def agree_drafts(self, planned: int) -> None:
        """The step's draft vote, once per speculative step on every EP rank, before its drafts:
        `planned` draft forwards this rank will run. With sharded draft experts each draft forward is a
        collective, so a rank below the group's maximum runs idle ones now (they pair, in order, with the
        others' forwards), as the backbone's vote does for its forwards."""
        drafts = self.draft_collectives
        if drafts is None or self.vote_group is None:
            return
        drafts.finish()
        count = torch.tensor([planned], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.vote_group)
        for _ in range(int(count) - planned):
            drafts.idle()

    def draft_forwards(self) -> int:
        """Draft forwards (real and idle) this rank has entered so far (0 without sharded draft experts)."""
        return 0 if self.draft_collectives is None else self.draft_collectives.forwards

    def settle_drafts(self, target: int) -> None:
        """After the drafts: a draft forward cut short is completed, and if the drafter ran fewer than it
        planned (it failed before one began), idle ones make up the count the others joined."""
        drafts = self.draft_collectives
        if drafts is None or self.vote_group is None:
            return
        drafts.finish()
        while drafts.forwards < target:
            drafts.idle()

    def eplb_stats(self) -> dict:
        """The EPLB counters of this rank's group (`EplbRunStats`, keys prefixed `eplb_`); {} without EPLB."""
        coll = self.collectives
        if coll is None or coll.eplb is None:
            return {}
        # forwards: real and idle ones submitted (all completed when a run ends), one EPLB step each
        return {
            **coll.eplb_stats.as_dict(),
            "ep_rank": self.state.ep.rank_in_group,
            "forwards": self.launched,
        }

    def attach_deepep(self, max_tokens: int, backend: str) -> bool:
        """Route the EP MoE's dispatch / combine through DeepEP (``backend``: auto / torch / deepep, from
        $DEEPINFER_EP_BACKEND). auto takes DeepEP on CUDA when `deep_ep` imports; the torch all-to-all
        (exact) otherwise. ``max_tokens``: the most tokens one forward of this rank can carry."""
        import deepinfer_parallel as par

        if backend not in ("auto", "torch", "deepep"):
            raise ValueError(f"DEEPINFER_EP_BACKEND must be auto, torch or deepep, got {backend!r}")
        if self.collectives is None or backend == "torch":
            return False
        usable = self.device.type == "cuda" and par.deep_ep_available()
        if backend == "deepep" and not usable:
            raise ValueError("DEEPINFER_EP_BACKEND=deepep needs a CUDA device and an importable deep_ep")
        if not usable:
            return False
        moe = self.collectives.moe
        cfg = moe.config
        moe.deepep = par.DeepEPDispatcher(
            self.state.ep.group, cfg.hidden_size, moe.top_k, moe.layout.num_physical, max_tokens
        )
        return True

    def close(self) -> None:
        """Release the DeepEP buffer (before the process groups go away)."""
        moe = self.collectives.moe if self.collectives is not None else None
        if moe is not None and moe.deepep is not None:
            moe.deepep.destroy()
            moe.deepep = None

    def wait_idle_forwards(self) -> None:
        """Wait for the idle forwards queued on the worker (async loop) at the end of a run: every
        rank of the group has submitted the forwards they join, so they all complete."""
        while self._idle_futures:
            self._idle_futures.popleft().result()

    def agree(self, busy: bool, launching: int, idle_inline: bool, run_idle, submit_idle=None) -> None:
        """The step's vote. `busy`: this rank has requests or forwards in flight; `launching`: real
        forwards it will run inline right after (sync loop: 0 or 1; the async loop counts its launches
        as it submits them). Idle forwards bring this rank up to the group's maximum: run inline
        (`run_idle`) or submitted behind the queued forwards (`submit_idle() -> Future`)."""
        while self._idle_futures and self._idle_futures[0].done():
            self._idle_futures.popleft().result()  # an idle forward that failed: the world is broken
        busy = busy or self.held_messages
        if self.vote_group is None:
            self.launched += launching
            self.any_busy = busy
            return
        mine = self.launched + launching
        # The messages count (max and -min): a rank that has not yet taken in a message the others
        # took in (possibly with no requests for it) must stay in the loop until it has, else it
        # would wait for that message while the others vote.
        vote = torch.tensor([mine, int(busy), self.messages, -self.messages], dtype=torch.int64)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.vote_group)
        most = int(vote[0])
        self.any_busy = bool(vote[1]) or int(vote[2]) != -int(vote[3])
        for _ in range(most - mine):
            if idle_inline:
                run_idle()
            else:
                self._idle_futures.append(submit_idle())
        self.launched = most
