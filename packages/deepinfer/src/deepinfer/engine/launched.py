"""One rank of a world started by `deepinfer launch` or torchrun (several hosts through the same variables).

    deepinfer launch --nproc 4 -- deepinfer generate --ep 4 --prompt ...
    torchrun --nnodes 2 --nproc-per-node 2 --master-addr HOST ... -m deepinfer.cli generate --ep 4 ...

Every rank runs the same program: it builds its own engine (its scheduler, its KV pools, the routed
experts of its EP slots; `rank_process.open_rank`, the same as a spawned rank) and every rank calls
`generate` with the same requests. There is no front: each rank computes the same assignment of the
requests to the data-parallel groups (`assign_ranks`, deterministic) and the same seed of each
request without `seq_seed` (one stream in request order, as one engine draws them), runs its share
with the per-step vote of its EP group (the all-to-alls stay matched, `dp_rank.py`), and at the end
the outputs are all-gathered, so `generate` returns every request's output on every rank. The ranks
of one context-parallel group run the same share in lockstep and the first of them reports it.

The rendezvous is torch.distributed's `env://` (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE); LOCAL_RANK
picks the GPU. The default group is gloo (it also carries the vote and the final gather), the device
groups NCCL on CUDA and gloo on the CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import random

import torch.distributed as dist

from ..engine_args import EngineArgs
from ..outputs import RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams
from .data_parallel import DataParallelStats, assign_ranks
from .prompts import front_seeds
from .rank_process import _stats, open_rank


class LaunchedEngine:
    """The `LLMEngine` interface `LLM` uses, on one rank of a launched world (see the module docstring).

    `add_request` queues; the first `step()` after it runs every queued request to completion on the
    world (collective: every rank must queue the same requests, in the same order) and returns all of
    their outputs."""

    def __init__(self, args: EngineArgs) -> None:
        launched = args.launched
        if launched is None:
            raise ValueError("LaunchedEngine needs a launched rank (RANK and WORLD_SIZE in the environment)")
        self.args, self.layout = args, args.layout
        self.rank, self.world = launched.rank, launched.world_size
        local_world = max(1, _local_world(launched.local_rank))
        self.engine, self.dp = open_rank(
            self.rank,
            launched.local_rank,
            args,
            "env://",
            float(max(args.distributed_startup_timeout, args.distributed_timeout)),
            local_world,
        )
        coords = self.layout.coords(self.rank)
        self.dp_group, self.cp_rank = coords.dp_rank, coords.cp_rank
        self.stats = DataParallelStats()
        self._seed_rng = random.Random(args.seed)
        self._pending: list[tuple] = []
        self._ready: list[RequestOutput] = []
        self._closed = False

    def __getattr__(self, name: str):
        # tokenizer, encode, validate_request, model facts: the rank's own engine answers them
        if name in ("engine", "dp", "_closed"):
            raise AttributeError(name)
        return getattr(self.engine, name)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in (r[0] for r in self._pending):
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_token_ids = self.engine.request_ids(prompt, prompt_token_ids, params)
        seeds = front_seeds(self._seed_rng, params)  # the same on every rank: requests come in one order
        self._pending.append((request_id, prompt, list(prompt_token_ids), params, seeds))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or bool(self._ready)

    def get_num_unfinished_requests(self) -> int:
        return len(self._pending)

    def step(self) -> list[RequestOutput]:
        """Run every queued request on the world and return all their outputs (collective)."""
        if self._pending:
            self._run(self._pending)
            self._pending = []
        done, self._ready = self._ready, []
        return done

    def abort_request(self, request_id: str) -> bool:
        for i, req in enumerate(self._pending):
            if req[0] == request_id:
                del self._pending[i]
                return True
        return False

    def abort_all(self) -> list[RequestOutput]:
        aborted = [
            RequestOutput(rid, prompt, ids, [], RequestMetrics(0.0), error="aborted")
            for rid, prompt, ids, _, _ in self._pending
        ]
        self._pending = []
        return aborted

    def scheduler_stats(self) -> dict:
        return self.engine.scheduler_stats()

    def close(self) -> None:
        """Close the rank's engine and leave the world (its statistics stay readable)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.engine.close()
        with contextlib.suppress(Exception):
            self.dp.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    # ------------------------------------------------------------------ internals
    def _run(self, pending: list[tuple]) -> None:
        self._check_same_requests(pending)
        groups = assign_ranks([len(r[2]) * r[3].n for r in pending], self.layout.dp)
        mine = [req for req, g in zip(pending, groups) if g == self.dp_group]
        local: list[RequestOutput] = []
        for rid, prompt, ids, params, seeds in mine:
            try:
                self.engine.add_request(rid, prompt, params, prompt_token_ids=ids, seeds=seeds)
            except ValueError as e:  # this request alone fails; the world goes on
                local.append(RequestOutput(rid, prompt, ids, [], RequestMetrics(0.0), error=str(e)))
        # Step until no rank of the EP group has work (the vote keeps the all-to-alls matched).
        while True:
            local += self.engine.step()
            if not self.dp.any_busy:
                break
        self.dp.wait_idle_forwards()
        report = (
            local if self.cp_rank == 0 else [],
            _stats(self.engine, self.dp) if self.cp_rank == 0 else None,
        )
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, report)
        by_id = {out.request_id: out for outs, _ in gathered for out in outs}
        self._ready += [by_id[rid] for rid, *_ in pending]
        self._update_stats([s for _, s in gathered if s is not None])

    def _check_same_requests(self, pending: list[tuple]) -> None:
        """Every rank must run the same requests: a rank that read other prompts would wait forever in
        a collective. Compared by a digest of (id, prompt ids, parameters, seeds)."""
        digest = hashlib.sha256(pickle.dumps([(r[0], r[2], repr(r[3]), r[4]) for r in pending])).hexdigest()
        digests: list = [None] * self.world
        dist.all_gather_object(digests, digest)
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise ValueError(
                f"every rank of a launched world must call generate with the same requests; rank(s) "
                f"{differ} queued other requests than rank 0"
            )

    def _update_stats(self, reports: list[dict]) -> None:
        """The world's `EngineStats`: the reporting ranks' counters summed (`steps` the largest)."""
        for name, value in vars(DataParallelStats()).items():
            if not isinstance(value, int | float) or name.startswith("eplb_"):
                continue
            values = [r.get(name, 0) for r in reports]
            setattr(self.stats, name, max(values) if name == "steps" else sum(values))


def _local_world(local_rank: int) -> int:
    """Ranks on this host (LOCAL_WORLD_SIZE, set by `deepinfer launch` and torchrun)."""
    import os

    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(raw) if raw.isdigit() else local_rank + 1


__all__ = ["LaunchedEngine"]
