"""A schedule's KV tier transfers: evicted blocks out of the pools into the tier, tier hits back in.

The scheduler reports, per `schedule()` call, the cached blocks it evicted and the blocks it counts as
loaded (`SchedulerOutput.evicted_blocks` / `block_loads`); `TierTransfers.apply` does both before the
step's forward, in the one order that is right for both sides: fetch the loads' entries (storing may push
them out of a bounded tier), read the evicted blocks out (a load may target one of them), write the loads
in, and keep the scheduler's set of loadable keys equal to what the tier holds.

Copies run synchronously on the engine's thread with no step in flight: the strategies take the
synchronous path for a step with transfers, since a block freed by a preemption in this very schedule may
still be written by the step in flight. A device stream would overlap them: `export_blocks` gathers every
evicted block in one copy per pool and `import_blocks` scatters every load in one copy per pool.

A load that fails (its file corrupt or gone, its metadata not the request's tokens) is never used: its
block is forgotten by the device cache, the key leaves the tier, and `apply` raises `TierLoadError`
naming the blocks after finishing the rest. The step strategies then send the sequences whose block
tables hold one of those blocks (the loading one, and any admitted in the same schedule that shares the
block) back to waiting, where they recompute what the tier could not give, and run the rest of the step.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from deepinfer_model import BlockPayload

from .kv_tier import Key, KVTier, key_name

logger = logging.getLogger("deepinfer")


class TierLoadError(RuntimeError):
    """Blocks the scheduler counted as loadable could not be loaded (named in the message); `blocks`
    are their device block ids, whose content is not the prefix the scheduler registered."""

    def __init__(self, message: str, blocks: list[int]) -> None:
        super().__init__(message)
        self.blocks = blocks


class TierTransfers:
    """`tier` below `runner`'s pools, kept in step with `scheduler`'s loadable keys."""

    def __init__(self, tier: KVTier, scheduler, runner, block_size: int) -> None:
        self.tier, self.scheduler, self.runner, self.block_size = tier, scheduler, runner, block_size
        self._announce(tier.keys(), add=True)  # what a shared disk directory already holds

    def refresh(self) -> None:
        """Before a schedule: the files that engines sharing the disk directory wrote become loadable,
        those they deleted stop being so (`KVTier.refresh`, at most every few seconds)."""
        appeared, gone = self.tier.refresh()
        self._announce(appeared, add=True)
        self._announce(gone, add=False)

    def apply(self, out) -> None:
        if not out.has_tier_transfers:
            return
        t0 = time.perf_counter()
        fetched, failed = self._fetch(out)
        t1 = time.perf_counter()
        self._store_evicted(out)
        t2 = time.perf_counter()
        if fetched:
            blocks = [b for b, _ in fetched]
            self.runner.import_blocks(blocks, BlockPayload.concat([p for _, p in fetched]))
        stats = self.tier.stats
        stats.load_s += (t1 - t0) + (time.perf_counter() - t2)
        stats.store_s += t2 - t1
        if failed:
            stats.failed_loads += len(failed)
            for block, key, _ in failed:
                self.scheduler.uncache_block(block)
                self.tier.discard(key)
            self._announce([key for _, key, _ in failed], add=False)
            raise TierLoadError(
                "KV tier load failed: " + "; ".join(f"block {key_name(k)}: {why}" for _, k, why in failed),
                [block for block, _, _ in failed],
            )

    def _fetch(self, out) -> tuple[list[tuple[int, BlockPayload]], list[tuple[int, Key, str]]]:
        seqs, indices, blocks, hashes, checks = out.block_loads
        fetched, failed = [], []
        tokens_of: dict[int, np.ndarray] = {}
        bs = self.block_size
        for seq_id, i, block, h, c in zip(
            seqs.tolist(), indices.tolist(), blocks.tolist(), hashes.tolist(), checks.tolist()
        ):
            key = (h, c)
            try:
                payload, where = self.tier.fetch(key)
            except KeyError:
                failed.append((block, key, "not in the tier"))
                continue
            except (OSError, ValueError) as e:
                failed.append((block, key, str(e)))
                continue
            if seq_id not in tokens_of:
                tokens_of[seq_id] = np.asarray(self.scheduler.token_ids(seq_id))
            want = tokens_of[seq_id][i * bs : (i + 1) * bs].tolist()
            meta = payload.meta
            if meta.get("hash") != h or meta.get("check") != c or meta.get("tokens") != want:
                failed.append((block, key, "its key or tokens are not the request's"))
                continue
            if where == "host":
                self.tier.stats.host_hits += 1
            else:
                self.tier.stats.disk_hits += 1
            fetched.append((block, payload))
        return fetched, failed

    def _store_evicted(self, out) -> None:
        ids, hashes, checks, tokens = out.evicted_blocks
        new, gone = [], []
        for b, h, c, t in zip(ids.tolist(), hashes.tolist(), checks.tolist(), tokens.tolist()):
            if (h, c) in self.tier:
                self.tier.touch((h, c))
                self.tier.stats.already_held += 1
            else:
                new.append((b, (h, c), t))
        if not new:
            return
        payload = self.runner.export_blocks([b for b, _, _ in new])
        added = []
        for i, (_, key, toks) in enumerate(new):
            meta = {"hash": key[0], "check": key[1], "tokens": toks}
            gone += self.tier.store(key, payload.block(i, meta))
            added.append(key)
        self.tier.stats.stored += len(new)
        gone_set = set(gone)
        self._announce([k for k in added if k not in gone_set], add=True)
        self._announce([k for k in gone_set if k not in added], add=False)

    def _announce(self, keys: list[Key], add: bool) -> None:
        if not keys:
            return
        hashes = np.fromiter((k[0] for k in keys), dtype=np.uint64, count=len(keys))
        checks = np.fromiter((k[1] for k in keys), dtype=np.uint64, count=len(keys))
        (self.scheduler.add_loadable if add else self.scheduler.drop_loadable)(hashes, checks)
