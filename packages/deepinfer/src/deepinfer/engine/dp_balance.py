"""Which data-parallel rank serves a request: the routing policies of the front (`data_parallel.py`).

Pure bookkeeping, no processes: the front tells a `Router` what it sent where and what the ranks
reported, and asks it where the next request goes and whether waiting requests should move.

* `static`: each batch the front holds is split longest first onto the least-loaded rank
  (`assign_ranks`), knowing nothing of what the ranks still hold.
* `round_robin`: request i of the run to rank i mod N.
* `balanced` (default): each request, longest of its batch first, goes to the rank where it adds the
  least to the estimated queued tokens, except that a rank holding its prompt's prefix (as estimated
  from the block-aligned prefix hashes the front routed there) keeps it unless that would overload it.
  Between steps, when one rank is overloaded, its waiting requests that have not started move to the
  least-loaded rank (`plan_move`).

Load is counted in tokens still to compute: for every unfinished sample, prompt plus output budget
(`request_cost`) less the tokens the rank has computed. A rank reports its load after each step, with
the number of front messages it had taken in; requests the front sent after that message count on top
of the report until a later report covers them, so the estimate neither misses nor double-counts
requests in flight between the processes.

A rank is overloaded when its load exceeds `overload_factor` x the mean load plus `slack_tokens`
(the slack keeps small absolute differences, which finish within a few steps, from moving anything).
A rank whose KV usage is at least `kv_high` takes no request for its prefix and is the last choice.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np
import xxhash

from ..envs import DP_ROUTING_POLICIES as POLICIES


def assign_ranks(costs: list[int], world: int) -> list[int]:
    """Rank of each request: longest first to the least-loaded rank (ties: lower index, lower rank).
    Deterministic, and within max(costs) of a perfect balance of the summed costs."""
    load = [0] * world
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += costs[i]
    return out


def request_cost(prompt_len: int, max_tokens: int, n: int, max_model_len: int) -> int:
    """Tokens a request asks a rank to compute: per sample its prompt and its output budget (capped,
    as the engine caps it, by the model length)."""
    return n * (prompt_len + max(0, min(max_tokens, max_model_len - prompt_len)))


def prefix_block_hashes(token_ids, block_size: int) -> list[int]:
    """One hash per full block of the prompt, each covering the whole prefix up to the block's end
    (chained), so that equal hashes mean equal prefixes, as the scheduler's prefix cache keys them."""
    ids = np.asarray(token_ids, dtype=np.int64)
    out, prev = [], 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = xxhash.xxh3_64(prev.to_bytes(8, "little"))
        h.update(ids[start : start + block_size].tobytes())
        prev = h.intdigest()
        out.append(prev)
    return out


class PrefixIndex:
    """Per rank, a bounded LRU of the prefix block hashes the front has routed there: an estimate of
    what that rank's prefix cache holds (the rank may have evicted some; it never holds others)."""

    def __init__(self, world: int, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be an integer >= 1, got {capacity_blocks!r}")
        self.capacity = capacity_blocks
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(world)]

    def overlap(self, rank: int, hashes: list[int]) -> int:
        """Leading blocks of `hashes` present on `rank`."""
        lru, count = self._lru[rank], 0
        for h in hashes:
            if h not in lru:
                break
            count += 1
        return count

    def record(self, rank: int, hashes: list[int]) -> None:
        lru = self._lru[rank]
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def __len__(self) -> int:
        return sum(len(lru) for lru in self._lru)

    def size(self, rank: int) -> int:
        return len(self._lru[rank])


@dataclasses.dataclass(frozen=True)
class RankLoad:
    """What a rank reports after a step."""

    queued_tokens: int = 0  # tokens still to compute in its waiting and running requests
    movable_tokens: int = 0  # of which in waiting requests that have not started (they may move)
    kv_usage: float = 0.0  # fraction of its KV blocks in use
    messages: int = 0  # front messages it had taken in when it measured


@dataclasses.dataclass(frozen=True)
class BalanceConfig:
    overload_factor: float = 1.25
    slack_tokens: int = 256
    kv_high: float = 0.95
    prefix_capacity_blocks: int = 4096  # per rank

    def __post_init__(self) -> None:
        if not self.overload_factor >= 1.0:
            raise ValueError(f"overload_factor must be >= 1.0, got {self.overload_factor!r}")
        if not isinstance(self.slack_tokens, int) or self.slack_tokens < 0:
            raise ValueError(f"slack_tokens must be an integer >= 0, got {self.slack_tokens!r}")
        if not 0.0 < self.kv_high <= 1.0:
            raise ValueError(f"kv_high must be in (0, 1], got {self.kv_high!r}")


@dataclasses.dataclass(frozen=True)
class Move:
    """Ask rank `src` to hand back waiting, not yet started requests of at most `budget_tokens`, for `dst`."""

    src: int
    dst: int
    budget_tokens: int


@dataclasses.dataclass
class RoutingStats:
    routed_requests: list[int]
    routed_tokens: list[int]
    prefix_routed: int = 0  # requests sent to a rank the index says holds part of their prefix
    prefix_blocks: int = 0  # their prefix blocks found there, summed
    moves: int = 0  # move requests the front sent
    moved_requests: int = 0
    moved_tokens: int = 0


class Router:
    """The front's routing state for `world` ranks under `policy` (one of `POLICIES`)."""

    def __init__(self, world: int, policy: str, block_size: int, config: BalanceConfig | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"dp_routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        if world < 1 or block_size < 1:
            raise ValueError(f"world and block_size must be >= 1, got {world} and {block_size}")
        self.world, self.policy, self.block_size = world, policy, block_size
        self.config = config or BalanceConfig()
        self.prefix = PrefixIndex(world, self.config.prefix_capacity_blocks)
        self.loads = [RankLoad() for _ in range(world)]
        self._unsent = [0] * world  # routed, not yet bound to a message
        self._in_flight: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # (message index, tokens)
        self._moving = [False] * world  # a move asked of this rank has not been answered
        self._next_rr = 0
        self.stats = RoutingStats([0] * world, [0] * world)

    # ------------------------------------------------------------------ load accounting
    def estimated(self, rank: int) -> int:
        """Tokens queued on `rank`: its last report plus what it had not taken in then."""
        return self.loads[rank].queued_tokens + sum(t for _, t in self._in_flight[rank]) + self._unsent[rank]

    def sent(self, rank: int, message_index: int) -> None:
        """The requests routed to `rank` since the last call left in front message `message_index`
        (1-based count of messages sent to it)."""
        if self._unsent[rank]:
            self._in_flight[rank].append((message_index, self._unsent[rank]))
            self._unsent[rank] = 0

    def report(self, rank: int, load: RankLoad) -> None:
        self.loads[rank] = load
        self._in_flight[rank] = [(i, t) for i, t in self._in_flight[rank] if i > load.messages]

    def overloaded(self, rank: int, extra: int = 0) -> bool:
        """Would `rank` be overloaded with `extra` more tokens?"""
        loads = [self.estimated(r) for r in range(self.world)]
        mean = (sum(loads) + extra) / self.world
        cfg = self.config
        return loads[rank] + extra > cfg.overload_factor * mean + cfg.slack_tokens

    # ------------------------------------------------------------------ routing
    def route_batch(self, requests: list[tuple[list[int], int]]) -> list[int]:
        """Rank of each (prompt token ids, cost) the front holds now, in their order."""
        costs = [c for _, c in requests]
        if self.policy == "static":
            ranks = assign_ranks(costs, self.world)
            for (_, cost), r in zip(requests, ranks):
                self._account(r, cost)
            return ranks
        if self.policy == "round_robin":
            ranks = []
            for _, cost in requests:
                ranks.append(self._next_rr)
                self._account(self._next_rr, cost)
                self._next_rr = (self._next_rr + 1) % self.world
            return ranks
        ranks = [0] * len(requests)
        for i in sorted(range(len(requests)), key=lambda i: (-costs[i], i)):
            ranks[i] = self.route(*requests[i])
        return ranks

    def route(self, token_ids: list[int], cost: int) -> int:
        """The balanced choice for one request (see the module docstring). A cached prefix makes the
        request cheaper on the rank that holds it for the choice; the load counts it whole until the
        rank reports it started."""
        hashes = prefix_block_hashes(token_ids, self.block_size)
        overlap = [self.prefix.overlap(r, hashes) for r in range(self.world)]
        # Cached prefix tokens need no compute on the rank that holds them (the last prompt token is
        # always computed).
        saved = [min(o * self.block_size, len(token_ids) - 1, cost) for o in overlap]
        extra = [cost - s for s in saved]
        loads = [self.estimated(r) for r in range(self.world)]
        full = [self.loads[r].kv_usage >= self.config.kv_high for r in range(self.world)]
        best = max(range(self.world), key=lambda r: (overlap[r], -loads[r], -r))
        if overlap[best] > 0 and not full[best] and not self.overloaded(best, extra[best]):
            rank = best
            self.stats.prefix_routed += 1
            self.stats.prefix_blocks += overlap[best]
        else:
            rank = min(range(self.world), key=lambda r: (full[r], loads[r] + extra[r], r))
        self.prefix.record(rank, hashes)
        # Counted whole, as the rank counts a request that has not started: its cached prefix shows
        # as computed once it is scheduled.
        self._account(rank, cost)
        return rank

    def assign(self, rank: int, token_ids: list[int], cost: int) -> None:
        """Account a request the front sends to `rank` by its own choice (a moved one)."""
        self.prefix.record(rank, prefix_block_hashes(token_ids, self.block_size))
        self._account(rank, cost)

    def _account(self, rank: int, cost: int) -> None:
        self._unsent[rank] += cost
        self.stats.routed_requests[rank] += 1
        self.stats.routed_tokens[rank] += cost

    # ------------------------------------------------------------------ rebalancing
    def plan_move(self) -> Move | None:
        """Balanced policy only: when the most-loaded rank is overloaded and reported waiting requests
        that have not started, ask it for up to half the gap to the least-loaded rank (a request no
        larger than that lowers the larger of the two loads). One move per rank at a time."""
        if self.policy != "balanced" or self.world < 2:
            return None
        loads = [self.estimated(r) for r in range(self.world)]
        src = max(range(self.world), key=lambda r: (loads[r], -r))
        dst = min(
            range(self.world), key=lambda r: (self.loads[r].kv_usage >= self.config.kv_high, loads[r], r)
        )
        budget = (loads[src] - loads[dst]) // 2
        if (
            src == dst
            or self._moving[src]
            or self.loads[src].movable_tokens <= 0
            or budget <= 0
            or not self.overloaded(src)
        ):
            return None
        self._moving[src] = True
        self.stats.moves += 1
        return Move(src, dst, budget)

    def moved(self, move: Move, message_index: int, costs: list[int]) -> None:
        """Rank `move.src` answered the move sent as its message `message_index`, handing back requests
        of `costs`: its reports before that message still count them, later ones no longer do."""
        self._moving[move.src] = False
        if costs:
            self._in_flight[move.src].append((message_index, -sum(costs)))
            self.stats.routed_requests[move.src] -= len(costs)
            self.stats.routed_tokens[move.src] -= sum(costs)
            self.stats.moved_requests += len(costs)
            self.stats.moved_tokens += sum(costs)
