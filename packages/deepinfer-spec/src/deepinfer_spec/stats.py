"""Acceptance statistics and throughput accounting for speculative decoding (spec §6.4, §10.1).

Definitions (per recorded window):
* acceptance rate at draft position j = accepted[j] / verified[j] (accepted = prefix-accepted);
* avg_accept_rate = Σ accepted / Σ verified; avg_accepted_len = Σ accepted / Σ request-steps;
  avg_verified_len = Σ verified / Σ request-steps; tokens per step = 1 + avg_accepted_len;
* avg_confidence_error = mean over verified drafts of |accept_prob - confidence|, where accept_prob
  = Σ_v min(p, q) is the true probability that the draft passes its test (the reference's measure);
* ECE = Σ_bins (n_b / N) · |mean confidence_b - mean accept_prob_b| with equal-width bins on [0, 1]
  (`reliability_bins` lists the bins' counts and means, the reliability diagram);
* full-acceptance throughput (the reference's headline) = steps/s × batch × (1 + nextn) / cp: it
  counts every draft as accepted. The real rate counts emitted tokens (one per request-step plus the
  accepted drafts). Both are reported side by side.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def full_acceptance_tokens_per_s(steps_per_s: float, batch: float, nextn: int, cp: int = 1) -> float:
    """The reference's decode throughput: assumes all nextn drafts of every request are accepted."""
    if nextn < 0:
        raise ValueError(f"nextn must be >= 0, got {nextn}")
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if steps_per_s < 0 or batch < 0:
        raise ValueError(f"steps_per_s and batch must be >= 0, got {steps_per_s} and {batch}")
    return steps_per_s * batch * (1 + nextn) / cp


def expected_calibration_error(
    confidences: Sequence[float], outcomes: Sequence[float], num_bins: int = 10
) -> float:
    """Binned ECE of `confidences` against `outcomes` (probabilities or 0/1), equal-width bins."""
    conf = np.asarray(confidences, dtype=np.float64)
    out = np.asarray(outcomes, dtype=np.float64)
    if conf.shape != out.shape:
        raise ValueError(
            f"confidences and outcomes must have the same length, got {conf.size} and {out.size}"
        )
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    if conf.size and (conf.min() < 0 or conf.max() > 1):
        raise ValueError("confidences must lie in [0, 1]")
    if conf.size == 0:
        return 0.0
    # Bin b holds [b/n, (b+1)/n); a confidence of exactly 1 goes to the last bin.
    bins = np.minimum((conf * num_bins).astype(np.int64), num_bins - 1)
    error = 0.0
    for b in np.unique(bins):
        sel = bins == b
        error += sel.sum() / conf.size * abs(conf[sel].mean() - out[sel].mean())
    return float(error)


class SpecStats:
    def __init__(self, nextn: int, cp: int = 1) -> None:
        if isinstance(nextn, bool) or not isinstance(nextn, int) or nextn < 0:
            raise ValueError(f"nextn must be an integer >= 0, got {nextn!r}")
        if cp < 1:
            raise ValueError(f"cp must be >= 1, got {cp}")
        self.nextn, self.cp = nextn, cp
        self.reset()

    def reset(self) -> None:
        self.verified = np.zeros(self.nextn, dtype=np.int64)
        self.accepted = np.zeros(self.nextn, dtype=np.int64)
        self.steps = 0
        self.request_steps = 0
        self.seconds = 0.0
        self.confidences: list[float] = []
        self.accept_probs: list[float] = []

    def record_step(
        self,
        num_verified: Sequence[int],
        num_accepted: Sequence[int],
        confidences: Sequence[float] | None = None,
        accept_probs: Sequence[float] | None = None,
        seconds: float | None = None,
    ) -> None:
        """One decode step: per request drafts verified / accepted; optionally the confidences and
        accept probabilities of the verified drafts (flat, packed order) and the step's wall time."""
        if len(num_verified) != len(num_accepted):
            raise ValueError(
                f"num_accepted must match num_verified in length, got {len(num_accepted)} vs {len(num_verified)}"
            )
        for k, a in zip(num_verified, num_accepted):
            if not 0 <= k <= self.nextn:
                raise ValueError(f"num_verified entries must be in [0, nextn={self.nextn}], got {k}")
            if not 0 <= a <= k:
                raise ValueError(f"num_accepted entries must be in [0, num_verified], got {a} for {k}")
            self.verified[:k] += 1
            self.accepted[:a] += 1
        total = sum(num_verified)
        if (confidences is None) != (accept_probs is None):
            raise ValueError("confidences and accept_probs must be given together")
        if confidences is not None:
            if len(confidences) != total or len(accept_probs) != total:
                raise ValueError(
                    f"confidences and accept_probs must have sum(num_verified)={total} entries, "
                    f"got {len(confidences)} and {len(accept_probs)}"
                )
            if any(not (0.0 <= c <= 1.0) for c in confidences):
                raise ValueError("confidences must lie in [0, 1]")
            self.confidences.extend(float(c) for c in confidences)
            self.accept_probs.extend(float(p) for p in accept_probs)
        if seconds is not None:
            if seconds < 0:
                raise ValueError(f"seconds must be >= 0, got {seconds}")
            self.seconds += seconds
        self.steps += 1
        self.request_steps += len(num_verified)

    # -- derived ---------------------------------------------------------------------------------
    def acceptance_rate_per_position(self) -> list[float | None]:
        return [float(a / v) if v else None for a, v in zip(self.accepted, self.verified)]

    @property
    def total_accepted(self) -> int:
        return int(self.accepted.sum())

    @property
    def total_verified(self) -> int:
        return int(self.verified.sum())

    @property
    def emitted_tokens(self) -> int:
        return self.request_steps + self.total_accepted

    def avg_accept_rate(self) -> float:
        return self.total_accepted / self.total_verified if self.total_verified else 0.0

    def avg_accepted_len(self) -> float:
        return self.total_accepted / self.request_steps if self.request_steps else 0.0

    def avg_verified_len(self) -> float:
        return self.total_verified / self.request_steps if self.request_steps else 0.0

    def tokens_per_request_step(self) -> float:
        return 1.0 + self.avg_accepted_len() if self.request_steps else 0.0

    def avg_confidence_error(self) -> float | None:
        if not self.confidences:
            return None
        return float(np.mean(np.abs(np.asarray(self.accept_probs) - np.asarray(self.confidences))))

    def calibration_error(self, num_bins: int = 10) -> float | None:
        if not self.confidences:
            return None
        return expected_calibration_error(self.confidences, self.accept_probs, num_bins)

    def reliability_bins(self, num_bins: int = 10) -> list[dict[str, float]]:
        """The reliability diagram behind `calibration_error`: per non-empty equal-width confidence bin,
        its edges, the number of verified drafts in it, their mean confidence and mean accept probability
        (the realised acceptance rate under greedy verification, where accept probabilities are 1 or 0)."""
        if num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {num_bins}")
        if not self.confidences:
            return []
        conf = np.asarray(self.confidences, dtype=np.float64)
        acc = np.asarray(self.accept_probs, dtype=np.float64)
        bins = np.minimum((conf * num_bins).astype(np.int64), num_bins - 1)  # as expected_calibration_error
        out = []
        for b in np.unique(bins):
            sel = bins == b
            out.append(
                {
                    "low": float(b / num_bins),
                    "high": float((b + 1) / num_bins),
                    "count": int(sel.sum()),
                    "mean_confidence": float(conf[sel].mean()),
                    "mean_accept_prob": float(acc[sel].mean()),
                }
            )
        return out

    def throughput(self) -> dict[str, float]:
        """Tokens per second both ways (needs step seconds recorded)."""
        if self.seconds <= 0 or self.steps == 0:
            raise ValueError("throughput needs recorded step seconds > 0")
        steps_per_s = self.steps / self.seconds
        batch = self.request_steps / self.steps
        return {
            "steps_per_s": steps_per_s,
            "full_acceptance_tok_per_s": full_acceptance_tokens_per_s(
                steps_per_s, batch, self.nextn, self.cp
            ),
            "accepted_tok_per_s": self.emitted_tokens / self.seconds / self.cp,
        }

    def summary(self) -> dict[str, object]:
        out = {
            "steps": self.steps,
            "request_steps": self.request_steps,
            "verified": self.total_verified,
            "accepted": self.total_accepted,
            "accept_rate_per_position": self.acceptance_rate_per_position(),
            "avg_accept_rate": self.avg_accept_rate(),
            "avg_accepted_len": self.avg_accepted_len(),
            "avg_verified_len": self.avg_verified_len(),
            "tokens_per_request_step": self.tokens_per_request_step(),
            "avg_confidence_error": self.avg_confidence_error(),
            "confidence_ece": self.calibration_error(),
            "confidence_reliability": self.reliability_bins(),
        }
        if self.seconds > 0:
            out.update(self.throughput())
        return out
