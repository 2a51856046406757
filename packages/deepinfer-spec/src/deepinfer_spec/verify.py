"""Verification of draft tokens against the target model, batched over requests of different lengths.

Packed layout (spec §5.5): request i verifies k_i drafts and owns 1 + k_i consecutive target rows
`[x, d1, ..., dk]` (x = its last committed token). Target row j (j < k) is the target's distribution
for the token after row j's input, so it verifies draft d_{j+1}; the last row is a fresh row.

* Greedy: draft d_{j+1} is accepted iff it equals the argmax of target row j (lowest id on ties).
* Sampling, coupled (the default, `coupled.py`): every row draws the token the plain sampler draws at
  its position (inverse CDF, uniform `stream_uniform(seed, base + j, SAMPLE)`), draft d_{j+1} is
  accepted iff it equals row j's draw, and the final token is the draw of the request's final row. The
  emitted tokens are the plain sampler's, whether or not a step verifies drafts.
* Sampling, rejection (`sampling="rejection"`): draft t ~ q is accepted iff U * q(t) < p(t), i.e. with
  probability min(1, p(t)/q(t)); the first rejected row resamples from the normalised residual
  max(0, p - q); if every verified draft is accepted the fresh row is sampled from p. The emitted
  sequence then has exactly the distribution of sampling from p step by step (Leviathan et al. 2023,
  Chen et al. 2023), but not the plain sampler's tokens.
* Prefix rule: a draft counts as accepted only if every earlier draft of its request was accepted.
* No token left: a target row may allow nothing (every token masked: a greedy row of -inf logits, a
  sampled row of zero mass). Its draft is rejected, so the request stops there; when that row is the
  request's final row the request has no final token (`VerifyResult.no_token`): it emits only its
  accepted drafts, and the caller fails it as the plain sampler fails such a row.

Every uniform comes from the request's stream: coupled, `stream_uniform(seed, base + j, SAMPLE)` (the
plain sampler's key of row j's position); rejection, `stream_uniform(seed, base + j * VERIFY_ROW_STRIDE,
purpose)`. So a request's result is a pure function of its own rows and key, whatever else is in the batch.

Devices: everything runs on the device of `target_probs`. Host inputs (draft ids, indices, the
streams' seeds and positions, built with numpy: no per-row Python) go there in one copy per call; the
uniforms are computed there (`stream_uniforms_tensor`), and the results come back in one copy
(`_to_host`): no per-row or per-token synchronisation. The accepted counts and final tokens also stay
on the device (`VerifyResult.accepted_device` / `final_device`). Bad distributions
are detected on the device and raised after that copy (rows with no token left are not bad: see above).
p and q are the *processed* distributions (after temperature / top-p / top-k / grammar mask) that the
model package's sampler computes; they need not be normalised.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .coupled import SAMPLED_VERIFY_MODES, coupled_agreement, draft_stream_seed
from .random_stream import VERIFY_ROW_STRIDE, Purpose, int64_bits, stream_uniforms_tensor


@dataclass
class VerifyResult:
    """What one verification step produced, per request (index i) and per verified draft (flat)."""

    num_drafts: list[int]  # k_i: drafts verified
    num_accepted: list[int]  # a_i: accepted drafts (prefix rule), 0 <= a_i <= k_i
    final_tokens: list[int]  # the correction (first rejected row) or bonus (fresh row) token; -1: no_token
    emitted: list[list[int]]  # accepted drafts then the final token: a_i + 1 tokens (a_i when no_token)
    # Flat over the Σ k_i verified drafts, in packed order (host tensors, whatever device verified):
    row_accepted: torch.Tensor  # bool: the row's own test passed (before the prefix rule)
    # float64: the probability that the row's test passes (1/0 when greedy): rejection, Σ_v min(p, q);
    # coupled, the overlap of p's and q's cumulative intervals (`coupled_agreement`)
    accept_probs: torch.Tensor
    # The same a_i and final tokens as long tensors on the verifying device, before the copy back: what
    # a step launched before this one's read-back (or a device-side length correction) consumes.
    accepted_device: torch.Tensor | None = None
    final_device: torch.Tensor | None = None
    # Per request: its final row allowed no token (every token masked); it emitted its accepted drafts only.
    no_token: list[bool] | None = None

    @property
    def num_emitted(self) -> list[int]:
        return [len(e) for e in self.emitted]

    def select(self, requests: Sequence[int]) -> VerifyResult:
        """The result of the requests at these indices only (in that order), e.g. those still running."""
        if list(requests) == list(range(len(self.num_drafts))):
            return self  # (every step without a failed request: no copy, nothing on the device)
        offsets = np.concatenate([[0], np.cumsum(self.num_drafts)]).astype(np.int64)
        flat = torch.as_tensor(
            [d for i in requests for d in range(offsets[i], offsets[i + 1])], dtype=torch.long, device="cpu"
        )

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return (
                None if t is None else t[torch.as_tensor(list(requests), dtype=torch.long, device=t.device)]
            )

        return VerifyResult(
            [self.num_drafts[i] for i in requests],
            [self.num_accepted[i] for i in requests],
            [self.final_tokens[i] for i in requests],
            [list(self.emitted[i]) for i in requests],
            self.row_accepted[flat],
            self.accept_probs[flat],
            pick(self.accepted_device),
            pick(self.final_device),
            None if self.no_token is None else [self.no_token[i] for i in requests],
        )

    def prefix_accepted(self) -> torch.Tensor:
        """bool [Σ k_i]: drafts that count as accepted (prefix rule)."""
        flags = [j < a for k, a in zip(self.num_drafts, self.num_accepted) for j in range(k)]
        return torch.tensor(flags, dtype=torch.bool, device="cpu")  # host bookkeeping, like row_accepted


_BAD_TARGET = "target_probs rows must be finite and >= 0"


def _validate_counts(name: str, values: Sequence, num_requests: int) -> None:
    if len(values) != num_requests:
        raise ValueError(f"{name} must have one entry per request ({num_requests}), got {len(values)}")


def inverse_cdf(
    weights: torch.Tensor, uniforms: torch.Tensor, cdf: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact inverse-CDF draw per row (float64, vocabulary order), as the model's sampler does.
    `uniforms` [rows] must be on the device of `weights` [rows, V]; the result is too. `cdf`: a buffer
    of the weights' shape and dtype the cumulative weights are written into (a caller drawing step
    after step reuses one: no [rows, V] allocation per draw)."""
    return _draw(weights, uniforms, cdf)[0]


def _draw(
    weights: torch.Tensor, uniforms: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`inverse_cdf`, and the rows' cumulative weights it searched (a caller reads each row's total
    there: the CDF's last column, no second pass over the rows)."""
    cdf = torch.cumsum(weights, dim=-1) if out is None else torch.cumsum(weights, dim=-1, out=out)
    total = cdf[:, -1]
    picked = torch.searchsorted(cdf, (uniforms * total)[:, None], right=True).squeeze(1)
    # u * total can round up to total: fall back to the last token with positive weight (the flag
    # rows are flipped, one byte an entry, not the float64 weights)
    last_nonzero = weights.shape[-1] - 1 - torch.argmax((weights > 0).flip(-1).view(torch.int8), dim=-1)
    return torch.minimum(picked, last_nonzero), cdf


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (list / numpy) as a `dtype` tensor on `device`: a view on the CPU; elsewhere one
    pinned, non-blocking copy (it queues behind the running kernels instead of stalling the host)."""
    host = torch.as_tensor(values, dtype=dtype, device="cpu")
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class _Packed:
    """Where each request's rows are in the packed batch, and its random-stream key: numpy arrays for the
    host bookkeeping (no per-row Python), their device copies (one transfer) for the tensor work."""

    ks: np.ndarray  # int64 [n]
    drafts: np.ndarray  # int64 [Σ k_i] draft ids (host)
    seeds: Sequence[int]
    base_positions: Sequence[int]
    greedy: np.ndarray  # bool [n]
    device: torch.device
    coupled: bool = False  # draw every sampled row at its own position (`coupled.py`)

    def __post_init__(self) -> None:
        n, total = len(self.ks), int(self.ks.sum())
        self.draft_offsets = np.concatenate([[0], np.cumsum(self.ks)]).astype(np.int64)
        req_of_draft = np.repeat(np.arange(n, dtype=np.int64), self.ks)
        local_of_draft = np.arange(total, dtype=np.int64) - self.draft_offsets[req_of_draft]
        # Flat draft d of request i is verified by target row d + i; request i's rows start at
        # draft_offsets[i] + i, its fresh row follows its last verify row.
        self.row_starts = self.draft_offsets[:-1] + np.arange(n, dtype=np.int64)
        self.sampled = np.flatnonzero(~self.greedy)
        self.sampled_drafts = np.flatnonzero(~self.greedy[req_of_draft])
        # One host-to-device copy of every index (and of the random streams' keys), sliced into views.
        parts = {
            "drafts": self.drafts,
            "verify_rows": np.arange(total, dtype=np.int64) + req_of_draft,
            "req_of_draft": req_of_draft,
            "local_of_draft": local_of_draft,
            "greedy_of_draft": self.greedy[req_of_draft],
            "greedy_of_row": np.repeat(self.greedy, self.ks + 1),
            "draft_offsets": self.draft_offsets[:-1],
            "row_starts": self.row_starts,
            "ks": self.ks,
            "sampled": self.sampled,
            "sampled_drafts": self.sampled_drafts,
        }
        if len(self.sampled) and self.coupled:
            # every row of a sampled request, keyed as the plain sampler keys the token at its position
            rows_of = np.repeat(np.arange(n, dtype=np.int64), self.ks + 1)
            local_of_row = np.arange(total + n, dtype=np.int64) - self.row_starts[rows_of]
            sampled_rows = np.flatnonzero(~self.greedy[rows_of])
            parts["sampled_rows"] = sampled_rows
            parts["row_seeds"] = int64_bits(self.seeds)[rows_of[sampled_rows]]
            base = np.asarray(self.base_positions, dtype=np.int64)
            parts["row_positions"] = base[rows_of[sampled_rows]] + local_of_row[sampled_rows]
            if self.greedy.any():  # the rows whose argmax coupled verification reads
                parts["greedy_rows"] = np.flatnonzero(self.greedy[rows_of])
        elif len(self.sampled):
            parts["seeds"] = int64_bits(self.seeds)
            parts["base_positions"] = np.asarray(self.base_positions, dtype=np.int64)
            kinds = [Purpose.ACCEPT, Purpose.RESIDUAL, Purpose.SAMPLE]
            parts["purposes"] = np.repeat(np.asarray(kinds, dtype=np.int64), [total, total, n])
        flat = to_device(
            np.concatenate([np.asarray(v, dtype=np.int64) for v in parts.values()]), torch.int64, self.device
        )
        self.dev = {}
        lo = 0
        for name, values in parts.items():
            self.dev[name] = flat[lo : lo + len(values)]
            lo += len(values)
        self.dev["greedy_of_draft"] = self.dev["greedy_of_draft"].bool()
        self.dev["greedy_of_row"] = self.dev["greedy_of_row"].bool()

    def uniforms(self) -> dict[Purpose, torch.Tensor]:
        """The uniforms on the device, computed there (`stream_uniforms_tensor`, bitwise the host stream):
        ACCEPT and RESIDUAL for every verified draft (flat, indexed by draft; row = its local index),
        SAMPLE at each request's fresh row k_i (indexed by request). Drawing the ones a step turns out
        not to need costs nothing on the host."""
        dev = self.dev
        req, local = dev["req_of_draft"], dev["local_of_draft"]
        seeds, base = dev["seeds"], dev["base_positions"]
        draft_pos = base[req] + local * VERIFY_ROW_STRIDE
        d = len(req)
        # the three kinds of draws in one pass of the stream (each op a kernel launch on the GPU)
        u = stream_uniforms_tensor(
            torch.cat([seeds[req], seeds[req], seeds]),
            torch.cat([draft_pos, draft_pos, base + dev["ks"] * VERIFY_ROW_STRIDE]),
            dev["purposes"],
        )
        return {Purpose.ACCEPT: u[:d], Purpose.RESIDUAL: u[d : 2 * d], Purpose.SAMPLE: u[2 * d :]}

    def row_uniforms(self) -> torch.Tensor:
        """Coupled: the plain sampler's uniform of each sampled request's row j, at position base + j
        (indexed like `dev["sampled_rows"]`), on the device."""
        return stream_uniforms_tensor(self.dev["row_seeds"], self.dev["row_positions"], Purpose.SAMPLE)


class DraftVerifier:
    """Greedy match and exact sampled verification over packed varlen rows.

    `sampling`: how sampled (temperature > 0) requests verify. "coupled" (default): each row draws the
    plain sampler's token at its position and a draft is accepted iff it equals it (`coupled.py`), so
    seeded outputs do not depend on which steps verify drafts; drafts must then be drawn with
    `draft_seed(seed)`. "rejection": rejection sampling (higher acceptance when q is near but not equal
    to p; tokens depend on which steps verified drafts).

    `draft_prob_penalty` (default 0: exact; rejection only) mirrors the reference's DRAFT_PROB_PENALTY
    (5e-5): the residual becomes max(p - q * exp(-penalty), 0), which keeps it non-empty at the cost of
    a bounded distribution error. With 0 a zero residual (only possible through rounding) falls back to
    the target's argmax.
    """

    def __init__(self, draft_prob_penalty: float = 0.0, sampling: str = "coupled") -> None:
        if not isinstance(draft_prob_penalty, int | float) or not (0.0 <= draft_prob_penalty < 1.0):
            raise ValueError(f"draft_prob_penalty must be in [0, 1), got {draft_prob_penalty!r}")
        if sampling not in SAMPLED_VERIFY_MODES:
            raise ValueError(f"sampling must be one of {SAMPLED_VERIFY_MODES}, got {sampling!r}")
        self.draft_scale = math.exp(-float(draft_prob_penalty))
        self.sampling = sampling
        self.coupled = sampling == "coupled"

    def draft_seed(self, seed: int) -> int:
        """The seed a request's drafts are drawn with (at their token positions, purpose SAMPLE) for
        this verifier: coupled, the request's own seed; rejection, seed + DRAFT_SEED_OFFSET."""
        return draft_stream_seed(seed, self.coupled)

    def verify(
        self,
        target_probs: torch.Tensor,
        draft_tokens: torch.Tensor | Sequence[int],
        num_drafts: Sequence[int],
        *,
        seeds: Sequence[int],
        base_positions: Sequence[int],
        greedy: Sequence[bool],
        draft_probs: torch.Tensor | None = None,
        golden: Sequence[Sequence[int] | None] | None = None,
    ) -> VerifyResult:
        """Verify the packed drafts of a batch.

        target_probs: [Σ (1 + k_i), V] target distributions (for greedy rows logits work as well), on
            the device the verification runs on; widened to float64 unless every request is greedy. A
            row may allow no token: -inf everywhere (a greedy row's masked logits) or zero mass (a
            sampled row); see `VerifyResult.no_token`.
        draft_tokens: [Σ k_i] draft ids; a negative id (padding) is always rejected. Best passed from
            the host (a list): a device tensor costs one extra copy back.
        draft_probs:  [Σ k_i, V] draft distributions q; needed when a sampled request verifies drafts. A
            zero row (the drafter had no token left there) rejects its draft.
        seeds, base_positions, greedy: per request; base_position is the request's plain decode position.
        golden: per request, forced tokens for its rows 0, 1, ... (-1 or missing: none; spec §5.6). A
            forced row emits its forced token, and its draft counts as accepted iff it equals it.
        """
        batch = self._validate(
            target_probs, draft_tokens, num_drafts, seeds, base_positions, greedy, draft_probs, self.coupled
        )
        ks, vocab, dev = batch.ks, target_probs.shape[1], batch.dev
        forced = self._forced_rows(golden, ks, vocab)
        # every request greedy: only argmaxes and the maxima's finiteness are read, and widening to float64
        # is exact and keeps the order, so the rows as given answer both (no widened copy of every row)
        target = target_probs.double() if len(batch.sampled) else target_probs
        checks: list[tuple[torch.Tensor, str]] = []  # (device flag, error): raised after the one copy back
        # coupled: a sampled row's argmax is never read (its token is its plain draw), so only greedy rows
        # take one; their no-token check reads it, the sampled rows' reads their plain draw's total
        plain = empty_mass = None
        if self.coupled and len(batch.sampled):
            argmax = self._greedy_argmax(target, batch)
            plain, empty_mass = self._plain_draws(target, argmax, batch, checks)
        else:
            argmax = torch.argmax(target, dim=-1)  # first maximum = lowest id
            # (a greedy row's no-token check reads its argmax alone)
            empty_mass = (
                target.sum(-1) == 0 if len(batch.sampled) else torch.zeros_like(argmax, dtype=torch.bool)
            )
        no_token_row = self._no_token_rows(target, argmax, dev["greedy_of_row"], empty_mass)
        drafts = dev["drafts"]
        valid = drafts >= 0
        safe_drafts = drafts.clamp(min=0)
        is_greedy = dev["greedy_of_draft"]

        # Greedy rows: accept iff the draft is the target's argmax (accept_prob is then 1 or 0).
        greedy_ok = valid & (argmax[dev["verify_rows"]] == drafts)
        row_accepted = greedy_ok
        accept_probs = greedy_ok.double()
        if self.coupled and plain is None:  # every request greedy: the plain token of a row is its argmax
            plain = argmax
        uniforms = batch.uniforms() if len(batch.sampled) and not self.coupled else None
        p_rows = q_rows = None
        if len(batch.sampled_drafts) and self.coupled:
            q_rows = draft_probs.to(target.device).double()
            q_total, bad_q = self._mass(q_rows)
            drawn = q_total > 0  # a zero q row: the drafter had no token there, its draft is void
            if len(batch.sampled_drafts) < len(is_greedy):  # (greedy requests' q rows are not checked)
                bad_q = bad_q[dev["sampled_drafts"]]
            checks.append((bad_q.any(), "draft_probs rows must be finite and >= 0"))
            # Exact whatever the drafts are: the emitted token of every row is its plain draw, and a draft
            # only counts when it is that token.
            sampled_ok = valid & drawn & (plain[dev["verify_rows"]] == drafts)
            row_accepted = torch.where(is_greedy, row_accepted, sampled_ok)
            # (the gathered rows are a copy: the agreement may work in them)
            agreement = coupled_agreement(target[dev["verify_rows"]], q_rows, overwrite_p=True)
            accept_probs = torch.where(is_greedy, accept_probs, agreement)
        elif len(batch.sampled_drafts):
            # Only sampled rows are normalised: greedy rows may carry logits and need only an argmax.
            sampled = dev["sampled_drafts"]
            p_rows = target[dev["verify_rows"]].clone()
            p_rows[sampled] = self._normalise(p_rows[sampled], "target_probs", checks)
            q_rows = draft_probs.to(target.device).double().clone()
            drawn = q_rows.sum(-1) > 0  # a zero q row: the drafter had no token there, its draft is void
            q_rows[sampled] = self._normalise(q_rows[sampled], "draft_probs", checks)
            p_t = p_rows.gather(1, safe_drafts[:, None]).squeeze(1)
            q_t = q_rows.gather(1, safe_drafts[:, None]).squeeze(1)
            # Division-free form of U < min(1, p/q); q(t) = 0 accepts iff p(t) > 0. A void draft is
            # rejected, and its row draws from the residual max(0, p - 0) = p: a plain draw, exact.
            sampled_ok = valid & drawn & (uniforms[Purpose.ACCEPT] * q_t < p_t)
            row_accepted = torch.where(is_greedy, row_accepted, sampled_ok)
            overlap = torch.minimum(p_rows, q_rows * self.draft_scale).sum(-1).clamp(0.0, 1.0)
            accept_probs = torch.where(is_greedy, accept_probs, overlap)

        forced_of_row = None
        if forced:
            rows = [-1] * (int(ks.sum()) + len(ks))
            for (i, j), tok in forced.items():
                rows[batch.row_starts[i] + j] = tok
            forced_of_row = to_device(rows, torch.int64, target.device)
            forced_draft = forced_of_row[dev["verify_rows"]]
            row_accepted = torch.where(forced_draft >= 0, forced_draft == drafts, row_accepted)
        # a row that allows no token accepts no draft, forced or not: the request stops at that row
        row_accepted = row_accepted & ~no_token_row[dev["verify_rows"]]

        # Prefix rule: a_i = local index of the first non-accepted draft of request i (k_i if none).
        first_rejected = torch.where(row_accepted, dev["ks"][dev["req_of_draft"]], dev["local_of_draft"])
        num_accepted = dev["ks"].scatter_reduce(0, dev["req_of_draft"], first_rejected, "amin")

        if plain is not None:
            final = plain[dev["row_starts"] + num_accepted]
        else:
            final = self._final_tokens(target, argmax, batch, num_accepted, p_rows, q_rows, uniforms, checks)
        if forced_of_row is not None:
            at_final = forced_of_row[dev["row_starts"] + num_accepted]
            final = torch.where(at_final >= 0, at_final, final)
        no_token = no_token_row[dev["row_starts"] + num_accepted]
        final = torch.where(no_token, -1, final)

        accepted_device, final_device = num_accepted, final
        num_accepted, final_tokens, row_accepted, accept_probs = _to_host(
            num_accepted, final, row_accepted, accept_probs, checks
        )
        offsets = batch.draft_offsets
        emitted = [
            [*batch.drafts[offsets[i] : offsets[i] + a].tolist(), *([t] if t >= 0 else [])]
            for i, (a, t) in enumerate(zip(num_accepted, final_tokens))
        ]
        return VerifyResult(
            ks.tolist(),
            num_accepted,
            final_tokens,
            emitted,
            row_accepted,
            accept_probs,
            accepted_device,
            final_device,
            [t < 0 for t in final_tokens],
        )

    @staticmethod
    def _validate(
        target_probs, draft_tokens, num_drafts, seeds, base_positions, greedy, draft_probs, coupled
    ):
        num_requests = len(num_drafts)
        for name, values in (("seeds", seeds), ("base_positions", base_positions), ("greedy", greedy)):
            _validate_counts(name, values, num_requests)
        ks = np.asarray(num_drafts, dtype=np.int64).reshape(-1)
        if (ks < 0).any():
            raise ValueError(f"num_drafts must be >= 0 per request, got {list(num_drafts)}")
        if (np.asarray(base_positions, dtype=np.int64) < 0).any():
            raise ValueError(f"base_positions must be >= 0, got {list(base_positions)}")
        total_drafts = int(ks.sum())
        total_rows = total_drafts + num_requests
        if target_probs.dim() != 2 or target_probs.shape[0] != total_rows:
            raise ValueError(
                f"target_probs must be [sum(1 + num_drafts)={total_rows}, vocab], got {tuple(target_probs.shape)}"
            )
        vocab = target_probs.shape[1]
        if isinstance(draft_tokens, torch.Tensor):
            draft_tokens = draft_tokens.reshape(-1).cpu().numpy()
        drafts = np.asarray(draft_tokens, dtype=np.int64).reshape(-1)
        if len(drafts) != total_drafts:
            raise ValueError(
                f"draft_tokens must have sum(num_drafts)={total_drafts} entries, got {len(drafts)}"
            )
        if total_drafts and drafts.max() >= vocab:
            raise ValueError(
                f"draft_tokens must be < vocab ({vocab}) (negative = padding), got {max(drafts)}"
            )
        if draft_probs is not None and tuple(draft_probs.shape) != (total_drafts, vocab):
            raise ValueError(
                f"draft_probs must be [sum(num_drafts)={total_drafts}, vocab={vocab}], got {tuple(draft_probs.shape)}"
            )
        greedy = np.asarray(greedy, dtype=bool).reshape(-1)
        if draft_probs is None and (~greedy & (ks > 0)).any():
            raise ValueError(
                "draft_probs is required when a sampled (temperature > 0) request verifies drafts"
            )
        return _Packed(ks, drafts, seeds, base_positions, greedy, target_probs.device, coupled)

    def _final_tokens(self, target, argmax, batch: _Packed, num_accepted, p_rows, q_rows, uniforms, checks):
        """The token of each request's final row [B] (device): its first rejected row, else its fresh row.
        Both are target row row_start + a: greedy requests take its argmax, sampled ones draw from the
        residual max(0, p - q) of their first rejected draft or, when all were accepted, from the fresh
        row exactly as a plain decode sample would (same weights, same rule, key at row k)."""
        dev = batch.dev
        final_rows = dev["row_starts"] + num_accepted
        final = argmax[final_rows]
        if not len(batch.sampled):
            return final
        s = dev["sampled"]
        a, k = num_accepted[s], dev["ks"][s]
        rejected = a < k
        weights = target[final_rows[s]]  # the fresh row of a request that accepted every draft
        _, bad = self._mass(weights)
        checks.append(((bad & ~rejected).any(), _BAD_TARGET))
        u = uniforms[Purpose.SAMPLE][s]
        empty = None
        if p_rows is not None:
            # The first rejected draft (clamped to a valid draft for requests that rejected none: unused).
            flat = (dev["draft_offsets"][s] + a).clamp(max=p_rows.shape[0] - 1)
            residual = (p_rows[flat] - q_rows[flat] * self.draft_scale).clamp(min=0.0)
            weights = torch.where(rejected[:, None], residual, weights)
            u = torch.where(rejected, uniforms[Purpose.RESIDUAL][flat], u)
            # A zero residual (only through rounding) falls back to the target's argmax.
            empty = rejected & (residual.sum(-1) <= 0)
        tokens = inverse_cdf(weights, u)
        if empty is not None:
            tokens = torch.where(empty, argmax[dev["verify_rows"][flat]], tokens)
        final[s] = tokens
        return final

    @staticmethod
    def _greedy_argmax(target, batch: _Packed) -> torch.Tensor:
        """[rows] (device): the argmax of every greedy request's row (first maximum = lowest id); 0 on the
        sampled requests' rows, whose argmax coupled verification never reads."""
        if not batch.greedy.any():
            return torch.zeros(target.shape[0], dtype=torch.int64, device=target.device)
        rows = batch.dev["greedy_rows"]
        return torch.zeros(target.shape[0], dtype=torch.int64, device=target.device).index_copy_(
            0, rows, torch.argmax(target[rows], dim=-1)
        )

    def _plain_draws(self, target, argmax, batch: _Packed, checks) -> tuple[torch.Tensor, torch.Tensor]:
        """Coupled: per packed row [rows] (device), the token the plain sampler emits at that row's
        position: greedy requests' argmax, sampled requests' inverse-CDF draw from the row's weights as
        given (not renormalised: the sampler draws from the same unnormalised float64 weights) with the
        uniform of (seed, base + j, SAMPLE); and per row whether a sampled row has no mass (its CDF's
        total is 0: no token left; False on greedy rows)."""
        tokens = argmax.clone()
        every_row = not batch.greedy.any()  # (then the sampled rows are all rows, in order: no copy)
        rows = batch.dev["sampled_rows"]
        weights = target if every_row else target[rows]
        drawn, cdf = _draw(weights, batch.row_uniforms())
        total = cdf[:, -1]
        # negative entries, or a non-finite total (a NaN or infinite entry): not a distribution
        checks.append((((weights < 0).any(-1) | ~torch.isfinite(total)).any(), _BAD_TARGET))
        if every_row:
            return drawn, total == 0
        tokens[rows] = drawn
        empty = torch.zeros(target.shape[0], dtype=torch.bool, device=target.device)
        empty[rows] = total == 0
        return tokens, empty

    @staticmethod
    def _forced_rows(golden, ks, vocab) -> dict[tuple[int, int], int]:
        """{(request, row): forced token} for rows 0..k_i of each request."""
        if golden is None:
            return {}
        _validate_counts("golden", golden, len(ks))
        forced = {}
        for i, window in enumerate(golden):
            for j, tok in enumerate(list(window or [])[: ks[i] + 1]):
                if int(tok) >= vocab:
                    raise ValueError(
                        f"golden[{i}] tokens must be < vocab ({vocab}) or -1 (none), got {int(tok)}"
                    )
                if int(tok) >= 0:
                    forced[(i, j)] = int(tok)
        return forced

    @staticmethod
    def _no_token_rows(
        target: torch.Tensor, argmax: torch.Tensor, greedy_of_row: torch.Tensor, empty_mass: torch.Tensor
    ) -> torch.Tensor:
        """bool [rows]: the row allows no token. A greedy row (logits) when its maximum is not finite, as
        the plain sampler judges a greedy row; a sampled row (probabilities) when it has no mass
        (`empty_mass`, read off its sum)."""
        top = target.gather(1, argmax[:, None]).squeeze(1)
        return torch.where(greedy_of_row, ~torch.isfinite(top), empty_mass)

    @staticmethod
    def _mass(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row sums and, per row, whether it is not a distribution (negative or non-finite entries)."""
        total = rows.sum(-1)
        return total, (rows < 0).any(-1) | ~torch.isfinite(total)

    @classmethod
    def _normalise(cls, rows: torch.Tensor, name: str, checks: list) -> torch.Tensor:
        """Rows scaled to sum 1; a row of zero mass (no token left) stays zero."""
        total, bad = cls._mass(rows)
        checks.append((bad.any(), f"{name} rows must be finite and >= 0"))
        return rows / torch.where(total > 0, total, 1.0)[:, None]


def _to_host(num_accepted, final, row_accepted, accept_probs, checks):
    """The step's results and error flags in ONE device-to-host copy (float64 holds every token id and
    count exactly); raises the first failed check."""
    n, d = num_accepted.shape[0], row_accepted.shape[0]
    parts = [num_accepted, final, row_accepted, accept_probs, *(flag.reshape(1) for flag, _ in checks)]
    host = torch.cat([p.double() for p in parts]).cpu()
    for (_, message), failed in zip(checks, host[2 * (n + d) :].tolist()):
        if failed:
            raise ValueError(message)
    ints = [int(v) for v in host[: 2 * n].tolist()]
    return ints[:n], ints[n:], host[2 * n : 2 * n + d].bool(), host[2 * n + d : 2 * (n + d)].clone()
