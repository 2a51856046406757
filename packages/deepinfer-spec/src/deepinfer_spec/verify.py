"""Verification of draft tokens against the target model, batched over requests of different lengths.

Packed layout (spec §5.5): request i verifies k_i drafts and owns 1 + k_i consecutive target rows
`[x, d1, ..., dk]` (x = its last committed token). Target row j (j < k) is the target's distribution
for the token after row j's input, so it verifies draft d_{j+1}; the last row is a fresh row.

* Greedy: draft d_{j+1} is accepted iff it equals the argmax of target row j (lowest id on ties).
* Sampling: draft t ~ q is accepted iff U * q(t) < p(t), i.e. with probability min(1, p(t)/q(t));
  the first rejected row resamples from the normalised residual max(0, p - q); if every verified
  draft is accepted the fresh row is sampled from p. The emitted sequence then has exactly the
  distribution of sampling from p step by step (Leviathan et al. 2023, Chen et al. 2023).
* Prefix rule: a draft counts as accepted only if every earlier draft of its request was accepted.

Every uniform comes from `stream_uniform(seed, base + j * VERIFY_ROW_STRIDE, purpose)`, so a
request's result is a pure function of its own rows and key, whatever else is in the batch.
p and q are the *processed* distributions (after temperature / top-p / top-k / grammar mask) that the
model package's sampler computes; they need not be normalised.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .random_stream import VERIFY_ROW_STRIDE, Purpose, stream_uniforms


@dataclass
class VerifyResult:
    """What one verification step produced, per request (index i) and per verified draft (flat)."""

    num_drafts: list[int]  # k_i: drafts verified
    num_accepted: list[int]  # a_i: accepted drafts (prefix rule), 0 <= a_i <= k_i
    final_tokens: list[int]  # the correction (first rejected row) or bonus (fresh row) token
    emitted: list[list[int]]  # accepted drafts then the final token: a_i + 1 tokens
    # Flat over the Σ k_i verified drafts, in packed order:
    row_accepted: torch.Tensor  # bool: the row's own test passed (before the prefix rule)
    accept_probs: torch.Tensor  # float64: Σ_v min(p, q) = probability the test passes (1/0 when greedy)

    @property
    def num_emitted(self) -> list[int]:
        return [a + 1 for a in self.num_accepted]

    def prefix_accepted(self) -> torch.Tensor:
        """bool [Σ k_i]: drafts that count as accepted (prefix rule)."""
        flags = [j < a for k, a in zip(self.num_drafts, self.num_accepted) for j in range(k)]
        return torch.tensor(flags, dtype=torch.bool)


def _validate_counts(name: str, values: Sequence, num_requests: int) -> None:
    if len(values) != num_requests:
        raise ValueError(f"{name} must have one entry per request ({num_requests}), got {len(values)}")


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Exact inverse-CDF draw per row (float64, vocabulary order), as the model's sampler does."""
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1]
    picked = torch.searchsorted(cdf, (uniforms * total)[:, None], right=True).squeeze(1)
    # u * total can round up to total: fall back to the last token with positive weight.
    last_nonzero = weights.shape[-1] - 1 - torch.argmax((weights.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(picked, last_nonzero)


@dataclass
class _Packed:
    """Where each request's rows are in the packed batch, and its random-stream key."""

    ks: list[int]
    seeds: Sequence[int]
    base_positions: Sequence[int]
    greedy: Sequence[bool]
    device: torch.device

    def __post_init__(self) -> None:
        self.draft_offsets = [0]
        for k in self.ks:
            self.draft_offsets.append(self.draft_offsets[-1] + k)
        self.req_of_draft = [i for i, k in enumerate(self.ks) for _ in range(k)]
        self.local_of_draft = [j for k in self.ks for j in range(k)]
        # Flat draft d of request i is verified by target row d + i; request i's fresh row follows its
        # last verify row.
        self.verify_rows = torch.tensor(
            [d + i for d, i in enumerate(self.req_of_draft)], dtype=torch.int64, device=self.device
        )
        self.fresh_rows = [self.draft_offsets[i] + k + i for i, k in enumerate(self.ks)]
        self.greedy_of_draft = torch.tensor(
            [bool(self.greedy[i]) for i in self.req_of_draft], dtype=torch.bool, device=self.device
        )

    def uniforms(self, requests: Sequence[int], rows: Sequence[int], purpose: Purpose) -> torch.Tensor:
        """Uniforms for request `requests[n]` at its verification row `rows[n]`."""
        positions = [int(self.base_positions[i]) + r * VERIFY_ROW_STRIDE for i, r in zip(requests, rows)]
        u = stream_uniforms([self.seeds[i] for i in requests], positions, purpose)
        return torch.from_numpy(u).to(self.device)


class DraftVerifier:
    """Greedy match and distribution-preserving rejection sampling over packed varlen rows.

    `draft_prob_penalty` (default 0: exact) mirrors the reference's DRAFT_PROB_PENALTY (5e-5): the
    residual becomes max(p - q * exp(-penalty), 0), which keeps it non-empty at the cost of a bounded
    distribution error. With 0 a zero residual (only possible through rounding) falls back to the
    target's argmax.
    """

    def __init__(self, draft_prob_penalty: float = 0.0) -> None:
        if not isinstance(draft_prob_penalty, int | float) or not (0.0 <= draft_prob_penalty < 1.0):
            raise ValueError(f"draft_prob_penalty must be in [0, 1), got {draft_prob_penalty!r}")
        self.draft_scale = math.exp(-float(draft_prob_penalty))

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

        target_probs: [Σ (1 + k_i), V] target distributions (for greedy rows logits work as well).
        draft_tokens: [Σ k_i] draft ids; a negative id (padding) is always rejected.
        draft_probs:  [Σ k_i, V] draft distributions q; needed when a sampled request verifies drafts.
        seeds, base_positions, greedy: per request; base_position is the request's plain decode position.
        golden: per request, forced tokens for its rows 0, 1, ... (-1 or missing: none; spec §5.6). A
            forced row emits its forced token, and its draft counts as accepted iff it equals it.
        """
        drafts, batch = self._validate(
            target_probs, draft_tokens, num_drafts, seeds, base_positions, greedy, draft_probs
        )
        ks, vocab = batch.ks, target_probs.shape[1]
        target = target_probs.double()
        argmax = torch.argmax(target, dim=-1)  # first maximum = lowest id
        valid = drafts >= 0
        safe_drafts = drafts.clamp(min=0)
        is_greedy = batch.greedy_of_draft

        # Greedy rows: accept iff the draft is the target's argmax (accept_prob is then 1 or 0).
        greedy_ok = valid & (argmax[batch.verify_rows] == drafts)
        row_accepted = greedy_ok.clone()
        accept_probs = greedy_ok.double()
        p_rows = q_rows = None
        if bool((~is_greedy).any()):
            # Only sampled rows are normalised: greedy rows may carry logits and need only an argmax.
            sampled = (~is_greedy).nonzero().squeeze(1)
            p_rows = target[batch.verify_rows].clone()
            p_rows[sampled] = self._normalise(p_rows[sampled], "target_probs")
            q_rows = draft_probs.to(target.device).double().clone()
            q_rows[sampled] = self._normalise(q_rows[sampled], "draft_probs")
            p_t = p_rows.gather(1, safe_drafts[:, None]).squeeze(1)
            q_t = q_rows.gather(1, safe_drafts[:, None]).squeeze(1)
            u = batch.uniforms(batch.req_of_draft, batch.local_of_draft, Purpose.ACCEPT)
            # Division-free form of U < min(1, p/q); q(t) = 0 accepts iff p(t) > 0.
            sampled_ok = valid & (u * q_t < p_t)
            row_accepted = torch.where(is_greedy, row_accepted, sampled_ok)
            overlap = torch.minimum(p_rows, q_rows * self.draft_scale).sum(-1).clamp(0.0, 1.0)
            accept_probs = torch.where(is_greedy, accept_probs, overlap)

        forced = self._forced_rows(golden, ks, vocab)
        draft_list = drafts.tolist()
        accepted_list = row_accepted.tolist()
        for (i, j), tok in forced.items():
            if j < ks[i]:
                accepted_list[batch.draft_offsets[i] + j] = tok == draft_list[batch.draft_offsets[i] + j]
        num_accepted = []
        for i, k in enumerate(ks):  # prefix rule
            a = 0
            while a < k and accepted_list[batch.draft_offsets[i] + a]:
                a += 1
            num_accepted.append(a)

        final_tokens = self._final_tokens(target, argmax, batch, num_accepted, p_rows, q_rows)
        for i in range(len(ks)):
            final_tokens[i] = forced.get((i, num_accepted[i]), final_tokens[i])
        emitted = [
            draft_list[batch.draft_offsets[i] : batch.draft_offsets[i] + num_accepted[i]] + [final_tokens[i]]
            for i in range(len(ks))
        ]
        return VerifyResult(
            ks,
            num_accepted,
            final_tokens,
            emitted,
            torch.tensor(accepted_list, dtype=torch.bool),
            accept_probs.cpu(),
        )

    @staticmethod
    def _validate(target_probs, draft_tokens, num_drafts, seeds, base_positions, greedy, draft_probs):
        num_requests = len(num_drafts)
        for name, values in (("seeds", seeds), ("base_positions", base_positions), ("greedy", greedy)):
            _validate_counts(name, values, num_requests)
        ks = [int(k) for k in num_drafts]
        if any(k < 0 for k in ks):
            raise ValueError(f"num_drafts must be >= 0 per request, got {list(num_drafts)}")
        if any(int(p) < 0 for p in base_positions):
            raise ValueError(f"base_positions must be >= 0, got {list(base_positions)}")
        total_drafts, total_rows = sum(ks), sum(ks) + num_requests
        if target_probs.dim() != 2 or target_probs.shape[0] != total_rows:
            raise ValueError(
                f"target_probs must be [sum(1 + num_drafts)={total_rows}, vocab], got {tuple(target_probs.shape)}"
            )
        vocab, device = target_probs.shape[1], target_probs.device
        drafts = torch.as_tensor(draft_tokens, dtype=torch.int64, device=device).reshape(-1)
        if drafts.numel() != total_drafts:
            raise ValueError(
                f"draft_tokens must have sum(num_drafts)={total_drafts} entries, got {drafts.numel()}"
            )
        if total_drafts and int(drafts.max()) >= vocab:
            raise ValueError(
                f"draft_tokens must be < vocab ({vocab}) (negative = padding), got {int(drafts.max())}"
            )
        if draft_probs is not None and tuple(draft_probs.shape) != (total_drafts, vocab):
            raise ValueError(
                f"draft_probs must be [sum(num_drafts)={total_drafts}, vocab={vocab}], got {tuple(draft_probs.shape)}"
            )
        if draft_probs is None and any(not g and k > 0 for g, k in zip(greedy, ks)):
            raise ValueError(
                "draft_probs is required when a sampled (temperature > 0) request verifies drafts"
            )
        return drafts, _Packed(ks, seeds, base_positions, greedy, device)

    def _final_tokens(self, target, argmax, batch: _Packed, num_accepted, p_rows, q_rows) -> list[int]:
        """The token of each request's final row: its first rejected row, else its fresh row."""
        final = [0] * len(batch.ks)
        fresh_sampled, residual = [], []
        for i, k in enumerate(batch.ks):
            rejected = num_accepted[i] < k
            if batch.greedy[i]:
                row = (
                    batch.verify_rows[batch.draft_offsets[i] + num_accepted[i]]
                    if rejected
                    else batch.fresh_rows[i]
                )
                final[i] = int(argmax[row])
            elif rejected:
                residual.append(i)
            else:
                fresh_sampled.append(i)

        if fresh_sampled:
            # Exactly a plain decode sample of this row: same weights, same rule, key at row k.
            weights = target[[batch.fresh_rows[i] for i in fresh_sampled]]
            self._check_mass(weights, "target_probs")
            u = batch.uniforms(fresh_sampled, [batch.ks[i] for i in fresh_sampled], Purpose.SAMPLE)
            for i, tok in zip(fresh_sampled, inverse_cdf(weights, u).tolist()):
                final[i] = tok
        if residual:
            flat = [batch.draft_offsets[i] + num_accepted[i] for i in residual]
            weights = (p_rows[flat] - q_rows[flat] * self.draft_scale).clamp(min=0.0)
            u = batch.uniforms(residual, [num_accepted[i] for i in residual], Purpose.RESIDUAL)
            tokens = inverse_cdf(weights, u)
            empty = weights.sum(-1) <= 0  # only through rounding: fall back to the target's argmax
            tokens = torch.where(empty, argmax[batch.verify_rows[flat]], tokens)
            for i, tok in zip(residual, tokens.tolist()):
                final[i] = tok
        return final

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
    def _check_mass(rows: torch.Tensor, name: str) -> torch.Tensor:
        total = rows.sum(-1)
        if bool((rows < 0).any()) or not bool(torch.isfinite(total).all()) or bool((total <= 0).any()):
            raise ValueError(f"{name} rows must be finite, >= 0 and have positive mass")
        return total

    @classmethod
    def _normalise(cls, rows: torch.Tensor, name: str) -> torch.Tensor:
        return rows / cls._check_mass(rows, name)[:, None]
