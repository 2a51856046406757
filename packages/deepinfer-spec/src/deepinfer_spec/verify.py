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
        self.draft_scale = float(torch.exp(torch.tensor(-float(draft_prob_penalty), dtype=torch.float64)))

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
        vocab = target_probs.shape[1]
        device = target_probs.device
        drafts = torch.as_tensor(draft_tokens, dtype=torch.int64, device=device).reshape(-1)
        if drafts.numel() != total_drafts:
            raise ValueError(
                f"draft_tokens must have sum(num_drafts)={total_drafts} entries, got {drafts.numel()}"
            )
        if total_drafts and int(drafts.max()) >= vocab:
            raise ValueError(
                f"draft_tokens must be < vocab ({vocab}) (negative = padding), got {int(drafts.max())}"
            )
        sampled_with_drafts = any(not g and k > 0 for g, k in zip(greedy, ks))
        if draft_probs is not None and tuple(draft_probs.shape) != (total_drafts, vocab):
            raise ValueError(
                f"draft_probs must be [sum(num_drafts)={total_drafts}, vocab={vocab}], got {tuple(draft_probs.shape)}"
            )
        if sampled_with_drafts and draft_probs is None:
            raise ValueError(
                "draft_probs is required when a sampled (temperature > 0) request verifies drafts"
            )

        # Flat draft d (request i, local j) is verified by target row d + i; request i's fresh row is
        # offset_i + k_i + i.
        req_of_draft = torch.repeat_interleave(
            torch.arange(num_requests, device=device), torch.tensor(ks, device=device)
        )
        local_of_draft = [j for k in ks for j in range(k)]
        verify_rows = torch.arange(total_drafts, device=device) + req_of_draft
        draft_offsets = [0]
        for k in ks:
            draft_offsets.append(draft_offsets[-1] + k)
        fresh_rows = [draft_offsets[i] + ks[i] + i for i in range(num_requests)]
        greedy_of_draft = torch.tensor(
            [bool(greedy[i]) for i in req_of_draft.tolist()], dtype=torch.bool, device=device
        )

        target = target_probs.double()
        argmax = torch.argmax(target, dim=-1)  # first maximum = lowest id
        valid = drafts >= 0
        safe_drafts = drafts.clamp(min=0)

        row_accepted = torch.zeros(total_drafts, dtype=torch.bool, device=device)
        accept_probs = torch.zeros(total_drafts, dtype=torch.float64, device=device)
        p_rows = q_rows = None
        if total_drafts:
            greedy_ok = valid & (argmax[verify_rows] == drafts)
            row_accepted = torch.where(greedy_of_draft, greedy_ok, row_accepted)
            accept_probs = torch.where(greedy_of_draft, greedy_ok.double(), accept_probs)
        if sampled_with_drafts:
            # Only sampled rows are normalised: greedy rows may carry logits and need only an argmax.
            sampled_idx = (~greedy_of_draft).nonzero().squeeze(1)
            p_rows = target[verify_rows].clone()
            p_rows[sampled_idx] = self._normalise(p_rows[sampled_idx], "target_probs")
            q_rows = draft_probs.to(device).double().clone()
            q_rows[sampled_idx] = self._normalise(q_rows[sampled_idx], "draft_probs")
            p_t = p_rows.gather(1, safe_drafts[:, None]).squeeze(1)
            q_t = q_rows.gather(1, safe_drafts[:, None]).squeeze(1)
            u = self._uniforms(
                req_of_draft.tolist(), local_of_draft, seeds, base_positions, Purpose.ACCEPT, device
            )
            # Division-free form of U < min(1, p/q); q(t) = 0 accepts iff p(t) > 0.
            sampled_ok = valid & (u * q_t < p_t)
            row_accepted = torch.where(greedy_of_draft, row_accepted, sampled_ok)
            overlap = torch.minimum(p_rows, q_rows * self.draft_scale).sum(-1).clamp(0.0, 1.0)
            accept_probs = torch.where(greedy_of_draft, accept_probs, overlap)

        forced = self._forced_rows(golden, ks, vocab)
        if forced:
            for (i, j), tok in forced.items():
                if j < ks[i]:
                    row_accepted[draft_offsets[i] + j] = bool(tok == int(drafts[draft_offsets[i] + j]))

        accepted_list = row_accepted.tolist()
        num_accepted = []
        for i, k in enumerate(ks):
            a = 0
            while a < k and accepted_list[draft_offsets[i] + a]:
                a += 1
            num_accepted.append(a)

        final_tokens = self._final_tokens(
            target,
            argmax,
            ks,
            num_accepted,
            draft_offsets,
            fresh_rows,
            seeds,
            base_positions,
            greedy,
            verify_rows,
            p_rows,
            q_rows,
        )
        for i in range(num_requests):
            final_tokens[i] = forced.get((i, num_accepted[i]), final_tokens[i])
        draft_list = drafts.tolist()
        emitted = [
            draft_list[draft_offsets[i] : draft_offsets[i] + num_accepted[i]] + [final_tokens[i]]
            for i in range(num_requests)
        ]
        return VerifyResult(ks, num_accepted, final_tokens, emitted, row_accepted.cpu(), accept_probs.cpu())

    def _final_tokens(
        self,
        target,
        argmax,
        ks,
        num_accepted,
        draft_offsets,
        fresh_rows,
        seeds,
        base_positions,
        greedy,
        verify_rows,
        p_rows,
        q_rows,
    ) -> list[int]:
        num_requests = len(ks)
        final = [0] * num_requests
        fresh_sampled, residual = [], []
        for i in range(num_requests):
            rejected = num_accepted[i] < ks[i]
            if greedy[i]:
                row = verify_rows[draft_offsets[i] + num_accepted[i]] if rejected else fresh_rows[i]
                final[i] = int(argmax[row])
            elif rejected:
                residual.append(i)
            else:
                fresh_sampled.append(i)

        if fresh_sampled:
            # Identical to a plain decode sample of this row (same weights, same key at row k).
            rows = [fresh_rows[i] for i in fresh_sampled]
            weights = target[rows]
            self._check_mass(weights, "target_probs")
            fresh_row_index = [ks[i] for i in fresh_sampled]
            u = self._uniforms(
                fresh_sampled, fresh_row_index, seeds, base_positions, Purpose.SAMPLE, target.device
            )
            for i, tok in zip(fresh_sampled, inverse_cdf(weights, u).tolist()):
                final[i] = tok
        if residual:
            flat = [draft_offsets[i] + num_accepted[i] for i in residual]
            weights = (p_rows[flat] - q_rows[flat] * self.draft_scale).clamp(min=0.0)
            rejected_at = [num_accepted[i] for i in residual]
            u = self._uniforms(residual, rejected_at, seeds, base_positions, Purpose.RESIDUAL, target.device)
            tokens = inverse_cdf(weights, u)
            empty = weights.sum(-1) <= 0  # only through rounding: fall back to the target's argmax
            fallback = argmax[verify_rows[flat]]
            tokens = torch.where(empty, fallback, tokens)
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
    def _uniforms(requests, rows, seeds, base_positions, purpose, device) -> torch.Tensor:
        """Uniforms for request `requests[n]` at its verification row `rows[n]`."""
        positions = [int(base_positions[i]) + r * VERIFY_ROW_STRIDE for i, r in zip(requests, rows)]
        u = stream_uniforms([seeds[i] for i in requests], positions, purpose)
        return torch.from_numpy(u).to(device)

    @staticmethod
    def _check_mass(rows: torch.Tensor, name: str) -> torch.Tensor:
        total = rows.sum(-1)
        if bool((rows < 0).any()) or not bool(torch.isfinite(total).all()) or bool((total <= 0).any()):
            raise ValueError(f"{name} rows must be finite, >= 0 and have positive mass")
        return total

    @classmethod
    def _normalise(cls, rows: torch.Tensor, name: str) -> torch.Tensor:
        return rows / cls._check_mass(rows, name)[:, None]
