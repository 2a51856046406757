"""How many drafts each request verifies this step (spec §2.6, `DEEPINFER_ENABLE_MTP_VARLEN`).

Off: every request verifies all of its drafts (nextn once it has drafts). On: every draft position of
the batch is ranked by its cumulative acceptance estimate (product of the confidences up to it = the
estimated probability that it and all earlier drafts are accepted); the batch total T is the one that
maximises expected emitted tokens per millisecond,

    (num_seqs + Σ top-T estimates) / (baseline(num_seqs + T) + slope · size + sampler_ms),

and request i then verifies as many drafts as it has among the top T. Estimates are non-increasing
along a request, so that is always a prefix of its drafts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .step_time import ForwardRuntimeEstimator, SamplerRuntimeEstimator, StepTimeCurve


@dataclass
class VarlenRequest:
    """One scheduled decode request as the varlen rule sees it.

    accept_rates: cumulative acceptance estimates of its current drafts (round N-1).
    prev_accept_rates: those of the drafts before (round N-2); the budget uses them when the last step
        is already processed, so that the total is the same with or without asynchronous scheduling.
    schedule_cnt / process_cnt: steps scheduled / post-processed for it (equal in a synchronous loop).
    """

    num_drafts: int
    accept_rates: Sequence[float] = ()
    prev_accept_rates: Sequence[float] = ()
    schedule_cnt: int = 0
    process_cnt: int = 0
    has_draft_info: bool = False


@dataclass
class VerifyPlan:
    num_verify: list[int]  # drafts to verify per request (a prefix of its drafts)
    expected_tokens: float  # estimated emitted tokens this step (num_seqs + Σ chosen estimates)
    predicted_ms: float | None  # step time the rule expects (None when varlen is off)
    candidates: list[tuple[int, float, float]] = field(default_factory=list)  # (tokens, expected, ms)

    @property
    def seqlens_q(self) -> list[int]:
        return [1 + k for k in self.num_verify]

    @property
    def num_tokens(self) -> int:
        return sum(self.seqlens_q)


def _check_rates(name: str, index: int, rates: Sequence[float], num_drafts: int) -> list[float]:
    rates = [float(r) for r in rates]
    if len(rates) not in (0, num_drafts):
        raise ValueError(
            f"requests[{index}].{name} must be empty or have num_drafts={num_drafts} entries, got {len(rates)}"
        )
    if any(not (0.0 <= r <= 1.0) for r in rates):
        raise ValueError(f"requests[{index}].{name} must lie in [0, 1], got {rates}")
    if any(b > a for a, b in zip(rates, rates[1:])):
        raise ValueError(
            f"requests[{index}].{name} must be non-increasing (cumulative products), got {rates}"
        )
    return rates


def split_by_rates(total_drafts: int, rates: Sequence[Sequence[float]]) -> list[int]:
    """Give the `total_drafts` highest-ranked positions (rate descending, ties by request index, then
    position) to their requests; returns drafts per request. Also the ZOS device-side re-split."""
    ranked = sorted(
        ((r, i, j) for i, req in enumerate(rates) for j, r in enumerate(req)),
        key=lambda e: (-e[0], e[1], e[2]),
    )
    if not 0 <= total_drafts <= len(ranked):
        raise ValueError(f"total_drafts must be in [0, {len(ranked)}], got {total_drafts}")
    counts = [0] * len(rates)
    for _, i, _ in ranked[:total_drafts]:
        counts[i] += 1
    return counts


def split_by_rates_tensor(
    total_drafts: int | torch.Tensor, rates: torch.Tensor, num_drafts: torch.Tensor
) -> torch.Tensor:
    """`split_by_rates` as tensor ops on the device of `rates` (the ZOS re-split of the verify lengths
    with the freshest confidences, spec §3.3): `rates` float [N, nextn] cumulative estimates, of which
    request i owns the first `num_drafts[i]` (long [N]); `total_drafts` an int or a 0-d device tensor
    (no host read). Same ranking: rate descending, ties by request index, then position (a stable
    descending sort of the row-major positions). -> long [N] drafts per request; a total beyond the
    owned positions gives every request all of its drafts."""
    n, width = rates.shape
    dev = rates.device
    owned = torch.arange(width, device=dev)[None, :] < num_drafts[:, None]
    ranked = torch.where(owned, rates.double(), torch.full((), -math.inf, dtype=torch.float64, device=dev))
    order = torch.sort(ranked.reshape(-1), descending=True, stable=True).indices
    taken = (torch.arange(n * width, device=dev) < total_drafts) & owned.reshape(-1)[order]
    counts = torch.zeros(n, dtype=torch.long, device=dev)
    return counts.index_add_(0, torch.div(order, width, rounding_mode="floor"), taken.long())


class ConfidenceScheduler:
    """The reference's MTP-varlen rule plus its runtime feedback (`update_runtime`)."""

    def __init__(self, nextn: int, curve: StepTimeCurve | None = None, enabled: bool | None = None) -> None:
        if isinstance(nextn, bool) or not isinstance(nextn, int) or nextn < 0:
            raise ValueError(f"nextn must be an integer >= 0, got {nextn!r}")
        self.nextn = nextn
        self.curve = curve
        self.enabled = (curve is not None) if enabled is None else bool(enabled)
        if self.enabled and curve is None:
            raise ValueError("curve is required when varlen is enabled (measure one or load it from a file)")
        self.forward_estimator = ForwardRuntimeEstimator()
        self.sampler_estimator = SamplerRuntimeEstimator()

    def choose(self, requests: Sequence[VarlenRequest]) -> VerifyPlan:
        num_seqs = len(requests)
        budget: list[tuple[float, int]] = []
        split_rates: list[list[float]] = []
        for i, req in enumerate(requests):
            nd = req.num_drafts
            if isinstance(nd, bool) or not isinstance(nd, int) or not 0 <= nd <= self.nextn:
                raise ValueError(
                    f"requests[{i}].num_drafts must be an integer in [0, nextn={self.nextn}], got {nd!r}"
                )
            if not req.process_cnt <= req.schedule_cnt <= req.process_cnt + 1:
                raise ValueError(
                    f"requests[{i}]: need process_cnt <= schedule_cnt <= process_cnt + 1, "
                    f"got schedule_cnt={req.schedule_cnt}, process_cnt={req.process_cnt}"
                )
            rates = _check_rates("accept_rates", i, req.accept_rates, nd)
            prev = _check_rates("prev_accept_rates", i, req.prev_accept_rates, nd)
            paired = req.process_cnt == req.schedule_cnt
            has_draft = req.has_draft_info or not paired
            pad = [1.0 if has_draft else 0.0] * nd
            for_budget = (prev if paired else rates) or pad
            split_rates.append(rates or pad)
            budget.extend((r, i) for r in for_budget)

        if not self.enabled:
            num_verify = [req.num_drafts for req in requests]
            expected = num_seqs + sum(sum(r[:k]) for r, k in zip(split_rates, num_verify))
            return VerifyPlan(num_verify, expected, None)

        budget.sort(key=lambda e: (-e[0], e[1]))
        candidates = []
        best_tokens, best_expected, best_ms, best_rate = num_seqs, float(num_seqs), None, -1.0
        expected, tokens = float(num_seqs), num_seqs
        for step in range(len(budget) + 1):
            if step:
                expected += budget[step - 1][0]
                tokens += 1
            ms = self.step_ms(tokens, num_seqs)
            if ms is None:
                break
            candidates.append((tokens, expected, ms))
            if expected / ms > best_rate:
                best_tokens, best_expected, best_ms, best_rate = tokens, expected, ms, expected / ms
        num_verify = split_by_rates(best_tokens - num_seqs, split_rates)
        return VerifyPlan(num_verify, best_expected, best_ms, candidates)

    def forward_ms(self, num_tokens: int) -> float | None:
        """Predicted forward milliseconds of a decode step of `num_tokens` query tokens: the curve's
        baseline plus the learned per-token residual; None where the curve does not reach."""
        charged = self.curve.charged(num_tokens)
        if charged is None:
            return None
        size, baseline = charged
        return baseline + max(0.0, self.forward_estimator.get()) * size

    def forward_ms_array(self, num_tokens: np.ndarray) -> np.ndarray:
        """`forward_ms` of many step sizes at once, NaN where the curve does not reach (bit for bit)."""
        size, baseline = self.curve.charged_array(num_tokens)
        return baseline + max(0.0, self.forward_estimator.get()) * size

    def step_ms(self, num_tokens: int, num_seqs: int) -> float | None:
        """`forward_ms` plus the sampler's time for `num_seqs` sequences (None where the curve does not
        reach)."""
        forward = self.forward_ms(num_tokens)
        return None if forward is None else forward + self.sampler_estimator.get(num_seqs)

    def update_runtime(self, num_tokens: int, forward_ms: float, num_seqs: int, sampler_ms: float) -> None:
        """Feed back a measured decode step (size = tokens charged, as the curve charges them)."""
        if not self.enabled:
            return
        charged = self.curve.charged(num_tokens)
        if charged is None:
            raise ValueError(
                f"num_tokens must be <= the curve's largest size {self.curve.max_tokens}, got {num_tokens}"
            )
        size, baseline = charged
        self.forward_estimator.add(size, (forward_ms - baseline) / size)
        self.sampler_estimator.add(num_seqs, sampler_ms)
