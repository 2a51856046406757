"""Adaptive drafting: a drafter that is rarely right costs almost nothing (`DEEPINFER_ENABLE_MTP_VARLEN`).

The MTP-varlen rule (`varlen.ConfidenceScheduler`) picks how many drafts to verify from the confidence
head and the step-time curve. It cannot see two things: whether the head is right (an untrained drafter
is confident about drafts that are never accepted), and the draft forward, which costs its time whether
anything is verified or not. `DraftPolicy` adds both, from measurements:

* `AcceptanceCalibration`: the head's confidence corrected by outcomes, per confidence bin (drafts
  verified / accepted, each conditional on the drafts before it being accepted, which is what the head
  predicts); an unmeasured bin trusts the head. The verification rule ranks the calibrated cumulative
  products.
* Per sequence, decayed counts of tested / accepted drafts per position (recent steps weigh most, the
  whole batch's counts as the prior): the expected acceptance of its next drafts, known before drafting.
  Drafts the rule chose not to verify count with their calibrated probability.
* `LinearCost`s: the draft forward's milliseconds as a + b·m for m drafting sequences, and the
  sampler's for m rows, apart for plain steps and for verification steps (whose exact distributions
  cost more per row than the plain sampler: a step that verifies anything pays for every row); and the
  host work of a step outside its forward, sampler and draft forward (building its inputs, committing,
  rolling back, bookkeeping) for m rows, apart for plain and verification steps. A verification step
  is charged what its host work adds to a plain step's of the same sequences, never less than 0: the
  plain step's own host work may be hidden behind the device (an asynchronous loop), what verification
  adds to it is not.

`plan` (before the draft forward) ranks the expected cumulative acceptance of every (sequence, position)
that may draft, as the varlen rule ranks drafts, and charges a total of T positions the step time of
num_seqs + T tokens (`step_ms`: the curve's forward, and the sampler of a plain step for T = 0, of a
verification step and its added host work otherwise) plus the draft forward of the sequences the top T
touch; the total with the most expected tokens per millisecond wins (T = 0: nobody drafts). A sequence
outside the best T skips the draft forward and backs off: no drafts for `min_backoff` plans, then a probe
(it drafts and verifies all of its drafts, so that its acceptance is measured again), the interval
doubling up to `max_backoff` while the probes do not pay. `verify_counts` (after the draft forward, whose
time is then spent) is the varlen rule's ranking of the calibrated rates, timed by `step_ms`; probes
verify everything.

Probes are exploration, and their cost is bounded: the time they added (their measured draft forward and
the longer step the curve charges) may reach `probe_budget` of the time of the plain steps planned so far.
The curve's milliseconds count there at the plain steps' measured wall ratio (`calibrate_budget`, which the
engine calls after each drafted step): a curve measured on eager forwards prices graphed GPU steps ~8x too
high, and plain time counted on it would let probes cost several times the budget in wall time. A probe
that falls due while the budget is spent waits, and the probes due then run together in one step: with a
draft forward of high fixed cost (host work), probes spread over many steps would make most steps pay it.
A drafter that is never right therefore costs about `probe_budget` of the plain decode time (plus one
probe step) once its sequences have backed off.

The cost model predicts each part of a step; the wall clock says what a step cost. With a `clock` (the
engine's), the policy times each planned step (from its plan to the next plan or `advance`: the draft
forward, the step, its host work and whatever the parts miss) and keeps the measured over predicted
time apart for steps planned with drafts and without (`wall_ratio`, the median of recent steps: a ratio,
so that it carries over to other batch sizes as the parts do). A plan charges a plain choice its
prediction times the plain steps' ratio, and a drafting one its prediction times the larger of the two
ratios (`charged_ms`): what steps cost beyond their parts (a step-time curve measured on another path
than the engine's steps) and what drafting adds (a loop that runs plain steps ahead and must wait for a
drafted one) then weigh in the choice; noise that catches plain steps slow never makes drafting look
cheaper, relative to plain steps, than its parts say. A kind with too few measurements has ratio 1.
Both kinds must be measured, the one a drafter that always pays never chooses too: once a few
drafted steps are timed, the first few plain ones are made to run (plans that let nobody draft,
`measuring_plain_steps`). A step with prefill in it is not a sample (`untimed_step`). The probe budget
stays on the parts' predictions, scaled as of the last `calibrate_budget` (so that `would_draft` can tell
ahead which plans it holds back: no plan changes the scale).

Determinism: the choices depend on measured times and on the other sequences of the batch. Greedy
outputs do not (verification keeps exactly the target's argmax tokens), nor do seeded sampled ones under
coupled verification (the default: every emitted token is the plain sampler's draw at its position).
Under rejection sampling a step that verifies k > 0 drafts draws its tokens differently from the plain
sampler, so seeded sampled outputs are then reproducible only where the same steps verify the same drafts.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from .state import cumulative_rates
from .varlen import ConfidenceScheduler, split_by_rates

_PERIODS = 16  # timed steps per kind whose median is the kind's wall ratio
_MIN_PERIODS = 3  # fewer: the kind's ratio is 1 (its predicted parts alone)


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return float(value)


def _decay(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
    return float(value)


def _reach(ms: np.ndarray) -> int:
    """How many of the leading totals the step-time curve prices (the first NaN ends them)."""
    beyond = np.flatnonzero(np.isnan(ms))
    return int(beyond[0]) if beyond.size else len(ms)


def _tested(num_verified: int, num_accepted: int) -> int:
    """Drafts whose acceptance was tested: the accepted ones and the first rejected one."""
    return min(num_accepted + 1, num_verified)


class AcceptanceCalibration:
    """P(draft accepted | earlier drafts accepted, confidence c) per equal-width confidence bin:
    (accepted_b + w·c) / (tested_b + w), counts decayed by `decay` per recorded sequence-step."""

    def __init__(self, num_bins: int = 10, prior_weight: float = 4.0, decay: float = 0.999) -> None:
        if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
            raise ValueError(f"num_bins must be an integer >= 1, got {num_bins!r}")
        self.num_bins = num_bins
        self.prior_weight = _positive("prior_weight", prior_weight)
        self.decay = _decay("decay", decay)
        self.tested = np.zeros(num_bins)
        self.accepted = np.zeros(num_bins)

    def _bins(self, confidences: np.ndarray) -> np.ndarray:
        return np.minimum((confidences * self.num_bins).astype(np.int64), self.num_bins - 1)

    def record(self, confidences: Sequence[float], num_verified: int, num_accepted: int) -> None:
        """One sequence's verified drafts (`confidences` of its drafts in order, at least num_verified)."""
        conf = np.asarray(confidences[: _tested(num_verified, num_accepted)], dtype=np.float64)
        self.tested *= self.decay
        self.accepted *= self.decay
        bins = self._bins(conf)
        np.add.at(self.tested, bins, 1.0)
        np.add.at(self.accepted, bins[:num_accepted], 1.0)

    def calibrated(self, confidences: Sequence[float]) -> list[float]:
        conf = np.clip(np.asarray(confidences, dtype=np.float64), 0.0, 1.0)
        bins = self._bins(conf)
        w = self.prior_weight
        return ((self.accepted[bins] + w * conf) / (self.tested[bins] + w)).tolist()


class LinearCost:
    """Milliseconds of a piece of work of size m (the draft forward of m sequences, the sampling of m
    rows): a + b·m by least squares over the last `window` measurements (a fixed cost where the fit
    falls with m, the line through the origin where its intercept is negative); b·m from the median
    time per unit while the measurements had one size only; 0 before the first, so that the first
    steps draft and measure."""

    def __init__(self, window: int = 64) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        # (fixed ms, ms per unit) of the current fit: a plan asks for hundreds of sizes between two
        # measurements, so the fit is made once per `add`, not per `get`
        self._fit: tuple[float, float] | None = None

    def add(self, num_seqs: int, ms: float) -> None:
        if num_seqs >= 1 and ms >= 0:
            self.samples.append((int(num_seqs), float(ms)))
            self._fit = None

    def get(self, num_seqs: int) -> float:
        if num_seqs <= 0 or not self.samples:
            return 0.0
        fixed, per_unit = self._line()
        return fixed + per_unit * num_seqs  # (0.0 + x and x + 0.0 * m are x: each case's exact value)

    def get_array(self, num_seqs: np.ndarray) -> np.ndarray:
        """`get` of many sizes at once (bit for bit)."""
        m = np.asarray(num_seqs, dtype=np.int64)
        if not self.samples:
            return np.zeros(m.shape)
        fixed, per_unit = self._line()
        return np.where(m > 0, fixed + per_unit * m, 0.0)

    def _line(self) -> tuple[float, float]:
        """(fixed ms, ms per unit) of the samples so far, fitted on the first ask after a measurement."""
        if self._fit is None:
            self._fit = self._fitted()
        return self._fit

    def _fitted(self) -> tuple[float, float]:
        # least squares by the normal equations in plain Python: a window of at most a few dozen points
        # (numpy's per-call overhead would be most of the time, and the engine refits after each step)
        n = len(self.samples)
        sx = sum(m for m, _ in self.samples)
        sy = sum(t for _, t in self.samples)
        sxx = sum(m * m for m, _ in self.samples)
        sxy = sum(m * t for m, t in self.samples)
        spread = n * sxx - sx * sx  # 0 while every measurement had one size
        if spread > 0:
            slope = (n * sxy - sx * sy) / spread
            intercept = (sy - slope * sx) / n
            if slope < 0:  # no growth with m: a fixed cost
                return sy / n, 0.0
            if intercept < 0:  # the line through the origin
                return 0.0, sxy / sxx
            return intercept, slope
        return 0.0, statistics.median(t / m for m, t in self.samples)


@dataclass
class _History:
    tested: np.ndarray  # decayed tested drafts per position
    accepted: np.ndarray  # decayed accepted drafts per position
    backoff: int = 0  # 0: the plan may pick it; else plans between its probes
    next_probe: int = 0  # plan number at which a backed-off sequence probes
    probing: bool = False  # its current drafts are a probe: verify them all
    evaluate: bool = False  # a probe's outcome is in: the next plan weighs it like an active sequence

    @property
    def backed_off(self) -> bool:
        """A plan does not weigh it: it waits for its probe (one whose outcome is in is weighed again)."""
        return bool(self.backoff) and not self.evaluate

    def probe_due(self, plan: int) -> bool:
        """Backed off, and its probe falls due at plan number `plan`."""
        return self.backed_off and plan >= self.next_probe


@dataclass
class DraftPlan:
    draft: list[bool]  # per candidate: it drafts after this step
    probe: list[bool]  # per candidate: it drafts as a probe (verifies all of its drafts)
    expected_tokens: float  # tokens the next step is expected to emit
    predicted_ms: float | None  # its step time plus the draft forward (None: the curve does not reach)


class DraftPolicy:
    """Who drafts and how many drafts are verified; see the module docstring."""

    def __init__(
        self,
        nextn: int,
        rule: ConfidenceScheduler,
        min_backoff: int = 4,
        max_backoff: int = 256,
        seq_decay: float = 0.7,
        batch_decay: float = 0.99,
        prior_weight: float = 2.0,
        calibration: AcceptanceCalibration | None = None,
        probe_budget: float | None = 0.05,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if isinstance(nextn, bool) or not isinstance(nextn, int) or nextn < 1:
            raise ValueError(f"nextn must be an integer >= 1, got {nextn!r}")
        if not rule.enabled:
            raise ValueError("the draft policy needs a varlen rule with a step-time curve (rule.enabled)")
        for name, value in (("min_backoff", min_backoff), ("max_backoff", max_backoff)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if max_backoff < min_backoff:
            raise ValueError(f"max_backoff must be >= min_backoff={min_backoff}, got {max_backoff}")
        self.nextn, self.rule = nextn, rule
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.seq_decay = _decay("seq_decay", seq_decay)
        self.batch_decay = _decay("batch_decay", batch_decay)
        self.prior_weight = _positive("prior_weight", prior_weight)
        if probe_budget is not None:
            probe_budget = _positive("probe_budget", probe_budget)
        self.probe_budget = probe_budget  # None: probes run whenever due
        self.calibration = calibration or AcceptanceCalibration()
        self.cost = LinearCost()  # the draft forward, per drafting sequence
        self.plain_sampler = LinearCost()  # sampling of a step without drafts, per row
        self.verify_sampler = LinearCost()  # verification of a step with drafts, per row
        self.plain_host = LinearCost()  # host work of a step without drafts, per row
        self.verify_host = LinearCost()  # host work of a step with drafts, per row
        self.batch_tested = np.zeros(nextn)
        self.batch_accepted = np.zeros(nextn)
        self._seqs: dict[Hashable, _History] = {}
        self.plans = 0
        self.drafted = self.skipped = self.probes = 0  # sequence-steps
        self.plain_ms = 0.0  # time of the plain steps planned so far (predicted, times budget_scale)
        self.probe_ms = 0.0  # time the probes added: the curve's longer steps, their measured draft forwards
        # wall ms per predicted ms of a plain step, as of the last `calibrate_budget` (1 until then): the
        # budget's curve-priced parts are scaled by it, so that a curve far above the steps it prices
        # (measured on eager forwards, the steps replaying graphs) does not widen the budget
        self.budget_scale = 1.0
        self.deferred_probes = 0  # sequence-plans a due probe waited for the budget
        self._probe_charge: int | None = None  # probes of the last plan, until their draft time is in
        self.clock = clock  # seconds; None: steps are not timed, the parts' predictions alone decide
        # measured over predicted time of recent timed steps, planned without / with drafts
        self.wall_ratios: dict[bool, deque[float]] = {
            False: deque(maxlen=_PERIODS),
            True: deque(maxlen=_PERIODS),
        }
        self._period: tuple[float, float, bool] | None = None  # (start, predicted ms, with drafts)
        self.timed_plans = {False: 0, True: 0}  # timed steps begun, without / with drafts
        self._last_begin: float | None = None  # the clock when the last timed step began

    # -- membership ------------------------------------------------------------------------------
    def _get(self, seq_id: Hashable) -> _History:
        h = self._seqs.get(seq_id)
        if h is None:
            h = self._seqs[seq_id] = _History(np.zeros(self.nextn), np.zeros(self.nextn))
        return h

    def remove(self, seq_id: Hashable) -> None:
        self._seqs.pop(seq_id, None)

    # -- estimates -------------------------------------------------------------------------------
    def batch_rates(self) -> np.ndarray:
        """Conditional acceptance per position over the batch (an optimistic prior of one accepted
        draft, so that a fresh engine drafts and measures)."""
        return (self.batch_accepted + 1.0) / (self.batch_tested + 1.0)

    def expected_rates(self, seq_id: Hashable, num_drafts: int) -> list[float]:
        """Estimated probability that the first j of the sequence's next drafts are all accepted."""
        h, w = self._get(seq_id), self.prior_weight
        conditional = (h.accepted + w * self.batch_rates()) / (h.tested + w)
        return cumulative_rates(conditional[:num_drafts])

    def step_ms(self, num_tokens: int, num_seqs: int) -> float | None:
        """Predicted milliseconds of a decode step of num_tokens tokens over num_seqs sequences: the
        rule's forward time and the sampler of a plain step (num_tokens = num_seqs) or of a
        verification step (the plain one's until a verification step is measured) plus the host work
        verification adds (`verify_host_ms`); None where the curve does not reach."""
        forward = self.rule.forward_ms(num_tokens)
        if forward is None:
            return None
        if num_tokens == num_seqs:
            return forward + self.plain_sampler.get(num_tokens)
        sampler = self.verify_sampler if self.verify_sampler.samples else self.plain_sampler
        return forward + sampler.get(num_tokens) + self.verify_host_ms(num_tokens, num_seqs)

    def step_ms_array(self, num_tokens: np.ndarray, num_seqs: int) -> np.ndarray:
        """`step_ms` of many step sizes over the same num_seqs sequences at once (a plan prices every total
        of drafts), NaN where the curve does not reach; each value `step_ms`'s, bit for bit."""
        n = np.asarray(num_tokens, dtype=np.int64)
        forward = self.rule.forward_ms_array(n)
        sampler = self.verify_sampler if self.verify_sampler.samples else self.plain_sampler
        added_host = np.maximum(0.0, self.verify_host.get_array(n) - self.plain_host.get(num_seqs))
        verify = forward + sampler.get_array(n) + added_host
        return np.where(n == num_seqs, forward + self.plain_sampler.get_array(n), verify)

    def verify_host_ms(self, num_tokens: int, num_seqs: int) -> float:
        """Host milliseconds a verification step of num_tokens rows over num_seqs sequences adds to the
        plain step of those sequences (0 until a verification step's host work is measured; the whole
        of it while no plain step's is)."""
        return max(0.0, self.verify_host.get(num_tokens) - self.plain_host.get(num_seqs))

    def wall_ratio(self, drafting: bool) -> float:
        """What a step planned with drafts (`drafting`) or without takes on the wall clock over what its
        parts predict: the median of its kind's recent timed steps; 1 while the kind has fewer than a
        few. (Not the other kind's: a policy that drafted on every step would then never learn that plain
        steps cost less than drafted ones.)"""
        samples = self.wall_ratios[drafting]
        return statistics.median(samples) if len(samples) >= _MIN_PERIODS else 1.0

    def charged_ms(self, predicted_ms: float, drafting: bool) -> float:
        """A step's predicted milliseconds as a plan charges them: times the plain steps' wall ratio, for a
        drafted step times the larger of the two (a clock that catches plain steps slow does not make
        drafting look cheaper, relative to plain steps, than its parts)."""
        return predicted_ms * self.charge_ratios()[drafting]

    def charge_ratios(self) -> tuple[float, float]:
        """The factors `charged_ms` applies to a plain step and to a drafted one (taken once per plan: the
        wall ratios change only when a step ends)."""
        plain = self.wall_ratio(False)
        return plain, max(plain, self.wall_ratio(True))

    def plain_step_ms(self, num_seqs: int) -> float | None:
        """A plain step of num_seqs sequences as plans charge it; None where the curve does not reach."""
        plain = self.step_ms(num_seqs, num_seqs)
        return None if plain is None else self.charged_ms(plain, False)

    def untimed_step(self) -> None:
        """The step in progress is not the one the last plan predicted (prefill in it): no sample."""
        self._period = None

    def measuring_plain_steps(self, num_seqs: int, plain_plans_before: int = 0) -> bool:
        """Whether the next plan over num_seqs decoding sequences (after `plain_plans_before` plans that
        let nobody draft) is one of the first plain steps of a timed policy that has timed drafted ones:
        it lets nobody draft, so that plain steps are measured too, whatever the parts predict."""
        if self.clock is None or self.timed_plans[True] < _MIN_PERIODS:
            return False
        if self.step_ms(num_seqs, num_seqs) is None:  # (such a plain step would not be timed)
            return False
        return self.timed_plans[False] + plain_plans_before < _MIN_PERIODS

    def _end_step(self) -> None:
        """The planned step ends now: its measured over predicted time is a sample of its kind."""
        if self.clock is None or self._period is None:
            return
        start, predicted, kind = self._period
        self._period = None
        elapsed_ms = (self.clock() - start) * 1e3
        if elapsed_ms > 0 and predicted > 0:  # (a clock that stands still measures nothing)
            self.wall_ratios[kind].append(elapsed_ms / predicted)

    def _begin_step(self, predicted_ms: float | None, drafting: bool) -> None:
        """A planned step predicted to take `predicted_ms` (None: not timed) begins now."""
        if self.clock is None or predicted_ms is None:
            return
        now = self.clock()
        self._period = (now, predicted_ms, drafting)
        if now != self._last_begin:  # (a clock that stands still times nothing: no step counts)
            self.timed_plans[drafting] += 1
        self._last_begin = now

    def record_step_time(self, num_rows: int, sample_ms: float, verified: bool) -> None:
        """A measured step's sampling (or verification) milliseconds over its `num_rows` logits rows."""
        (self.verify_sampler if verified else self.plain_sampler).add(num_rows, sample_ms)

    def record_host_time(self, num_rows: int, host_ms: float, verified: bool) -> None:
        """A measured decode step's host milliseconds over its `num_rows` rows, outside its forward, its
        sampler or verification and the draft forward."""
        (self.verify_host if verified else self.plain_host).add(num_rows, host_ms)

    # -- before the draft forward ------------------------------------------------------------------
    def plan(self, candidates: Sequence[tuple[Hashable, int]], num_seqs: int) -> DraftPlan:
        """candidates: (seq_id, drafts it may propose, >= 1) of the sequences that may draft for the next
        step; num_seqs: the sequences that step decodes (>= len(candidates))."""
        if num_seqs < len(candidates):
            raise ValueError(f"num_seqs must be >= len(candidates)={len(candidates)}, got {num_seqs}")
        for seq_id, k in candidates:
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.nextn:
                raise ValueError(
                    f"drafts for {seq_id!r} must be an integer in [1, nextn={self.nextn}], got {k!r}"
                )
        self._end_step()
        if self.measuring_plain_steps(num_seqs):
            self.advance([seq_id for seq_id, _ in candidates], num_seqs)
            nobody = [False] * len(candidates)
            return DraftPlan(nobody, list(nobody), float(num_seqs), self.plain_step_ms(num_seqs))
        self.plans += 1
        forced, members = [], []
        for idx, (seq_id, _) in enumerate(candidates):
            h = self._get(seq_id)
            if h.probe_due(self.plans):
                forced.append(idx)
            elif not h.backed_off:
                members.append(idx)
        forced = self._afford_probes(candidates, forced, num_seqs)
        # probes draft whatever the plan says: their tokens, expected tokens and draft time come first
        tokens = num_seqs + sum(candidates[i][1] for i in forced)
        expected = float(num_seqs)
        for i in forced:
            expected += sum(self.expected_rates(*candidates[i]))
        ranked = sorted(
            ((r, idx, j) for idx in members for j, r in enumerate(self.expected_rates(*candidates[idx]))),
            key=lambda e: (-e[0], e[1], e[2]),
        )
        # every total T of the top-ranked positions priced at once: expected tokens, sequences drafting
        # (the probes and those the top T touch), the step with their draft forward, as charged
        touched: set[int] = set()
        touched_after = [0]  # sequences the top T positions belong to, for T = 0 .. len(ranked)
        for _, idx, _ in ranked:
            touched.add(idx)
            touched_after.append(len(touched))
        drafting = len(forced) + np.asarray(touched_after)
        expected_at = np.cumsum([expected, *(r for r, _, _ in ranked)])  # (sequential, as += is)
        ms = self.step_ms_array(tokens + np.arange(len(ranked) + 1), num_seqs)
        reach = _reach(ms)
        best_total, best_expected, best_ms, predicted = 0, expected, None, None
        if reach:
            ms = ms[:reach] + self.cost.get_array(drafting[:reach])
            ratios = self.charge_ratios()
            charged = ms * np.where(drafting[:reach] > 0, ratios[1], ratios[0])
            best_total = int(np.argmax(expected_at[:reach] / charged))  # (the first of equal rates)
            best_expected, best_ms = float(expected_at[best_total]), float(charged[best_total])
            predicted = float(ms[best_total])
        chosen = {idx for _, idx, _ in ranked[:best_total]}
        draft, probe = [False] * len(candidates), [False] * len(candidates)
        for idx in forced:
            draft[idx] = probe[idx] = True
            self._get(candidates[idx][0]).probing = True
        for idx in members:
            h = self._get(candidates[idx][0])
            if idx in chosen:
                draft[idx], h.backoff = True, 0
            else:
                h.backoff = self.min_backoff if h.backoff == 0 else min(2 * h.backoff, self.max_backoff)
                h.next_probe = self.plans + h.backoff
            h.evaluate = False
        self.drafted += sum(draft)
        self.probes += len(forced)
        self.skipped += len(candidates) - sum(draft)
        self._begin_step(predicted, any(draft))
        return DraftPlan(draft, probe, best_expected, best_ms)

    def _afford_probes(self, candidates, due: list[int], num_seqs: int) -> list[int]:
        """The due probes while the probes so far cost at most the budget (else none: they wait, still
        due, and run together later). What a probe costs is charged once it is known: the longer step
        now (the curve), its draft forward when measured (`record_draft_time`)."""
        plain = self.step_ms(num_seqs, num_seqs)
        if plain is not None:
            self.plain_ms += plain * self.budget_scale
        self._probe_charge = None
        if not due or self.probe_budget is None or plain is None:
            return due
        if self._budget_spent(self.plain_ms):
            self.deferred_probes += len(due)
            return []
        longer = self.step_ms(num_seqs + sum(candidates[i][1] for i in due), num_seqs)
        self.probe_ms += max(0.0, longer - plain) * self.budget_scale if longer is not None else 0.0
        self._probe_charge = len(due)
        return due

    def record_draft_time(self, num_seqs: int, ms: float) -> None:
        """A measured draft forward of `num_seqs` sequences; after a plan with probes, the probes' share of
        it (all of it where only probes drafted, else the time beyond the others' predicted forward)
        goes to the probe budget."""
        probes, self._probe_charge = self._probe_charge, None
        if probes:
            others = num_seqs - probes
            self.probe_ms += ms if others <= 0 else max(0.0, ms - self.cost.get(others))
        self.cost.add(num_seqs, ms)

    # -- after the draft forward -------------------------------------------------------------------
    def verify_counts(
        self, seq_ids: Sequence[Hashable], confidences: Sequence[Sequence[float]], num_seqs: int
    ) -> list[int]:
        """Drafts to verify per drafted sequence (`confidences`: the head's, one per draft): the varlen
        rule's choice on the calibrated rates (positions ranked by rate, the best total by expected
        tokens per millisecond, a prefix per sequence) with the step timed by `step_ms`; the other
        num_seqs - len(seq_ids) decode sequences verify none. A probe verifies all of its drafts."""
        if len(confidences) != len(seq_ids):
            raise ValueError(
                f"confidences must have one list per seq_id ({len(seq_ids)}), got {len(confidences)}"
            )
        if num_seqs < len(seq_ids):
            raise ValueError(f"num_seqs must be >= len(seq_ids)={len(seq_ids)}, got {num_seqs}")
        rates = [cumulative_rates(self.calibration.calibrated(c)) if len(c) else [] for c in confidences]
        probing = [self._get(s).probing for s in seq_ids]
        tokens = num_seqs + sum(len(r) for r, p in zip(rates, probing) if p)
        expected = float(num_seqs) + sum(sum(r) for r, p in zip(rates, probing) if p)
        free = [[] if p else r for r, p in zip(rates, probing)]
        ranked = sorted((r for req in free for r in req), reverse=True)
        expected_at = np.cumsum([expected, *ranked])  # every total of the best-ranked drafts at once
        ms = self.step_ms_array(tokens + np.arange(len(ranked) + 1), num_seqs)
        reach = _reach(ms)
        best_total = int(np.argmax(expected_at[:reach] / ms[:reach])) if reach else 0
        counts = split_by_rates(best_total, free)
        return [len(r) if p else k for r, p, k in zip(rates, probing, counts)]

    def record(
        self, seq_id: Hashable, confidences: Sequence[float], num_verified: int, num_accepted: int
    ) -> None:
        """The outcome of a sequence's drafts: `confidences` of all it drafted, of which the first
        `num_verified` were verified and `num_accepted` accepted. Drafts left unverified after an
        all-accepted prefix count with their calibrated probability (the rule judged them not worth
        verifying: that is what the sequence's next drafts are expected to be worth too)."""
        num_drafts = len(confidences)
        if not 0 <= num_accepted <= num_verified <= num_drafts <= self.nextn:
            raise ValueError(
                f"need 0 <= num_accepted <= num_verified <= len(confidences) <= nextn={self.nextn}, got "
                f"{num_accepted}, {num_verified}, {num_drafts}"
            )
        if num_drafts == 0:
            return
        tested, accepted = np.zeros(self.nextn), np.zeros(self.nextn)
        tested[: _tested(num_verified, num_accepted)] = 1.0
        accepted[:num_accepted] = 1.0
        if num_accepted == num_verified < num_drafts:
            tested[num_verified:num_drafts] = 1.0
            accepted[num_verified:num_drafts] = self.calibration.calibrated(confidences[num_verified:])
        if num_verified:
            self.calibration.record(confidences, num_verified, num_accepted)
        h = self._get(seq_id)
        h.tested = h.tested * self.seq_decay + tested
        h.accepted = h.accepted * self.seq_decay + accepted
        self.batch_tested = self.batch_tested * self.batch_decay + tested
        self.batch_accepted = self.batch_accepted * self.batch_decay + accepted
        if h.probing:
            h.probing, h.evaluate = False, True

    def summary(self) -> dict:
        offered = self.drafted + self.skipped
        return {
            "policy_drafted_seq_steps": self.drafted,
            "policy_skipped_seq_steps": self.skipped,
            "policy_probe_seq_steps": self.probes,
            "policy_draft_fraction": self.drafted / offered if offered else None,
            "policy_deferred_probe_seq_plans": self.deferred_probes,
            "policy_probe_ms_fraction": self.probe_ms / self.plain_ms if self.plain_ms else None,
            "policy_wall_ratio_plain": self.wall_ratio(False) if self.clock is not None else None,
            "policy_wall_ratio_draft": self.wall_ratio(True) if self.clock is not None else None,
        }

    # -- plans that let nobody draft, for a loop that runs such steps ahead -----------------------------
    def would_draft(self, seq_ids: Sequence[Hashable], num_seqs: int, lookahead: int = 1) -> bool:
        """Whether `plan` over the candidates `seq_ids` (num_seqs decoding), made `lookahead` plans from
        now (1: the next plan; the ones before it letting nobody draft, as `advance` counts them), would
        weigh any of them: a sequence it does not know yet, one that is not backed off (an active
        member, or a probe whose outcome is in), or a backed-off one whose probe is due then and within
        the probe budget. False: that plan lets none of them draft and changes none of their histories,
        and `advance` then does exactly what it would. Changes nothing."""
        self._check_plain_plan(seq_ids, num_seqs)
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
            raise ValueError(f"lookahead must be an integer >= 1, got {lookahead!r}")
        if self.measuring_plain_steps(num_seqs, lookahead - 1):
            return False
        at, due = self.plans + lookahead, False
        for seq_id in seq_ids:
            h = self._seqs.get(seq_id)
            if h is None or not h.backed_off:
                return True
            due = due or h.probe_due(at)
        if not due:
            return False
        plain = self.step_ms(num_seqs, num_seqs)
        if self.probe_budget is None or plain is None:
            return True
        plain_ms = self.plain_ms
        for _ in range(lookahead):  # as the plans up to that one add it (the same float additions)
            plain_ms += plain * self.budget_scale
        return not self._budget_spent(plain_ms)

    def advance(self, seq_ids: Sequence[Hashable], num_seqs: int) -> None:
        """A plan over the candidates `seq_ids` in which nobody drafts, for a step that ran without one:
        the plan counter, the plain time the probe budget is measured against, the skipped sequence-steps
        and the deferred probes advance as in `plan`, so that probes fall due at the same plans. Where
        `would_draft(seq_ids, num_seqs)` is False this is exactly `plan`; otherwise the sequences `plan`
        would have weighed keep their state for the next plan (a member stays one, a due probe stays
        due)."""
        self._check_plain_plan(seq_ids, num_seqs)
        self._end_step()
        self.plans += 1
        due = sum(
            1 for seq_id in seq_ids if (h := self._seqs.get(seq_id)) is not None and h.probe_due(self.plans)
        )
        plain = self.step_ms(num_seqs, num_seqs)  # as `_afford_probes` counts a plan's plain step
        if plain is not None:
            self.plain_ms += plain * self.budget_scale
        self._probe_charge = None
        if due and self.probe_budget is not None and plain is not None and self._budget_spent(self.plain_ms):
            self.deferred_probes += due
        self.skipped += len(seq_ids)
        self._begin_step(plain, False)  # as `plan` times a plan that lets nobody draft

    def _check_plain_plan(self, seq_ids: Sequence[Hashable], num_seqs: int) -> None:
        if isinstance(num_seqs, bool) or not isinstance(num_seqs, int) or num_seqs < len(seq_ids):
            raise ValueError(f"num_seqs must be an integer >= len(seq_ids)={len(seq_ids)}, got {num_seqs!r}")

    def calibrate_budget(self) -> None:
        """From now on the probe budget prices the curve's milliseconds at the plain steps' wall ratio
        (`wall_ratio(False)`; 1 without a clock): plain time and a probe's longer step count as wall time,
        as its measured draft forward already does. The engine calls it after a drafted step, never
        within a plan, so that a plan's answer stays what `would_draft` says it will be."""
        self.budget_scale = self.wall_ratio(False)

    def _budget_spent(self, plain_ms: float) -> bool:
        """The probes so far cost more than `probe_budget` of `plain_ms` (the plain steps' time)."""
        return self.probe_ms > self.probe_budget * plain_ms
