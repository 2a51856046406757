"""The sampler: one token per logits row, each row with its own parameters and random stream."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from deepinfer_spec import Purpose, stream_uniform

from ..runtime.device import to_device
from .bitmask import TokenBitmask, apply_token_bitmask_
from .params import RowParams
from .processors import process_logits_
from .transform import filtered_probs


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [B]
    # Raw model log-probabilities (log_softmax of the logits before any transform), only when a row
    # asked for logprobs: chosen token [B], and the top-n ids / values [B, max n] (n per row in params).
    logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    # `defer_checks=True`: bool [B], True for a row, greedy or sampled, left with no token it may produce
    # (its token is then meaningless); None otherwise
    empty_rows: torch.Tensor | None = None


EMPTY_ROW_MESSAGE = (
    "no token left with positive probability: every token is banned (stop_token_ids or EOS before "
    "min_tokens, the decode blacklist) or disallowed by the structured-output grammar"
)


class Sampler:
    """Greedy / temperature / top-p / top-k / min-p sampling with seeded per-row streams.

    The draw is exact inverse-CDF sampling: u = uniform(seed, position, purpose) picks the token whose
    cumulative (float64, vocabulary order) probability interval contains u * total. u depends only on
    the row's key, and the CDF only on the row's logits, so the result is independent of the batch.

    Nothing here waits for the device unless a check needs a value (`defer_checks=False`, the default,
    reads whether a sampled row has any token left): row indices and per-row parameters reach the device
    through pinned asynchronous copies, so the asynchronous loop can enqueue a step's sampling and the
    next step before either has run.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[RowParams],
        allowed: torch.Tensor | TokenBitmask | None = None,
        purpose: Purpose = Purpose.SAMPLE,
        overwrite_logits: bool = False,
        defer_checks: bool = False,
    ) -> SamplerOutput:
        """allowed: the tokens each row may produce (structured output): a bool [B, V] tensor, or a
        packed `TokenBitmask` for some of the rows (the cheap form: no dense mask is built).
        overwrite_logits: the caller is done with `logits`, so masking may write into them instead
        of into a copy (a whole [B, V] allocation less); ignored when a row asks for logprobs (they
        are taken from the unmasked logits).
        defer_checks: instead of raising ValueError when a row has no token left, flag it in
        `empty_rows` (no host read here; the caller fails that row alone once it reads the tokens).
        A greedy row has none when its argmax is not finite (every logit masked), a sampled row when
        its filtered distribution has no mass: both fail alike instead of emitting a banned token."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
        raw = logits.float()
        wants = [r.logprobs for r in rows if r.logprobs is not None]
        # raw is our own copy when .float() converted; otherwise it is the caller's tensor
        inplace = not wants and (overwrite_logits or raw.data_ptr() != logits.data_ptr())
        masked = masked_logits(raw, rows, allowed, inplace=inplace)
        dev = raw.device
        greedy = [i for i, r in enumerate(rows) if r.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.greedy]
        bad = None
        if not sampled:  # (every row greedy: the decode benchmarks, temperature 0)
            tokens = torch.argmax(masked, dim=-1)  # first maximum = lowest id
        else:
            tokens = torch.empty(len(rows), dtype=torch.int64, device=dev)
            if greedy:
                g = to_device(np.asarray(greedy, dtype=np.int64), dev)
                tokens[g] = torch.argmax(masked[g], dim=-1)
            idx = to_device(np.asarray(sampled, dtype=np.int64), dev) if greedy else None
            probs = filtered_probs(
                masked if idx is None else masked[idx], [rows[i] for i in sampled]
            ).double()
            cdf = torch.cumsum(probs, dim=-1)
            total = cdf[:, -1]
            bad = (total <= 0) | ~torch.isfinite(total)
            u = to_device(
                np.array([stream_uniform(rows[i].seed, rows[i].position, purpose) for i in sampled]), dev
            )
            picked = torch.searchsorted(cdf, (u * total)[:, None], right=True).squeeze(1)
            # u * total can round up to total; fall back to the last token with positive probability.
            last_nonzero = probs.shape[-1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
            picked = torch.minimum(picked, last_nonzero)
            if idx is None:
                tokens = picked
            else:
                tokens[idx] = picked
                sampled_bad = torch.zeros(len(rows), dtype=torch.bool, device=dev)
                sampled_bad[idx] = bad
                bad = sampled_bad
        # A chosen token whose masked logit is not finite was banned: for a greedy row that means every
        # token was (a sampled row that is not `bad` only draws tokens of positive probability).
        empty = ~torch.isfinite(masked.gather(1, tokens[:, None]).squeeze(1))
        if bad is not None:
            empty |= bad
        if not defer_checks and bool(empty.any()):
            raise ValueError(EMPTY_ROW_MESSAGE)

        out = SamplerOutput(token_ids=tokens, empty_rows=empty if defer_checks else None)
        if wants:
            logprobs = torch.log_softmax(raw, dim=-1)
            out.logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
            top_n = max(wants)
            if top_n > 0:
                out.top_logprobs, out.top_token_ids = torch.topk(logprobs, min(top_n, raw.shape[-1]), dim=-1)
        return out


def masked_logits(
    raw: torch.Tensor,
    rows: list[RowParams],
    allowed: torch.Tensor | TokenBitmask | None,
    inplace: bool = False,
) -> torch.Tensor:
    """`raw` with each row's banned tokens and disallowed tokens (structured output) set to -inf, then
    its logits processors applied (`processors.py`: allowed ids, bad words, bias, penalties).

    inplace: write into `raw` and return it. Otherwise a new tensor when anything changes and
    `raw` itself (unmodified) when nothing does. A `TokenBitmask` touches only its rows.
    """
    banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids if 0 <= t < raw.shape[-1]]
    if isinstance(allowed, TokenBitmask):
        allowed.check(raw)
        if not allowed.rows:
            allowed = None
    processed = any(r.processed for r in rows)
    if not banned and allowed is None and not processed:
        return raw
    masked = raw if inplace else raw.clone()
    if banned:
        row_idx, tok_idx = (to_device(np.asarray(v, dtype=np.int64), raw.device) for v in zip(*banned))
        masked[row_idx, tok_idx] = float("-inf")
    if isinstance(allowed, TokenBitmask):
        apply_token_bitmask_(masked, allowed)
    elif allowed is not None:
        masked.masked_fill_(~allowed.to(device=masked.device, dtype=torch.bool), float("-inf"))
    if processed:
        process_logits_(masked, rows)
    return masked
