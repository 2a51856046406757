"""Acceptance of sampled drafts: coupled verification (the default) against rejection sampling, exactly.

    uv run --no-sync python benchmarks/spec/bench_coupled_acceptance.py
    uv run --no-sync python benchmarks/spec/bench_coupled_acceptance.py --vocab 129280 --rows 16

Per draft, the probability that it is accepted given the target's processed distribution p and the
drafter's q (float64, no sampling):
  rejection  Σ min(p, q): rejection sampling, the largest any exact scheme reaches;
  coupled    the overlap of p's and q's cumulative intervals in vocabulary order (`coupled_agreement`):
             the draft and the plain sampler's inverse-CDF draw share one uniform;
  gumbel     Σ_x 1 / Σ_y max(p_y/p_x, q_y/q_x): what a shared-noise (Gumbel-max) draw would agree on, for
             reference only: the plain sampler does not draw that way, and coupling must match its draw.

SYNTHETIC distributions, not a model's: target logits −a·log(rank) (Zipf-like, exponent a) at random
vocabulary ids; the drafter's logits are the target's plus N(0, σ²) noise (σ = 0: q = p). Then
temperature, top-k and top-p as the sampler applies them (`deepinfer_model.filtered_probs`).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from deepinfer_model import RowParams, filtered_probs
from deepinfer_spec import coupled_agreement
from rich.console import Console
from rich.table import Table


def gumbel_agreement(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Σ_x P(x wins both exponential races) = Σ_x 1 / (Σ_{r_y >= r_x} p_y / p_x + Σ_{r_y < r_x} q_y / q_x),
    r = p / q, per row, in O(V log V) (sorted by r, prefix sums)."""
    out = []
    for pr, qr in zip(p.double(), q.double()):
        pr, qr = pr / pr.sum(), qr / qr.sum()
        both = (pr > 0) & (qr > 0)
        ratio = torch.where(qr > 0, pr / qr.clamp(min=1e-300), torch.inf)
        order = torch.argsort(ratio, descending=True)
        p_sorted, q_sorted = pr[order], qr[order]
        p_at_or_above = torch.cumsum(p_sorted, 0)  # Σ p_y over r_y >= r_x (ties: either side is equal)
        q_below = qr.sum() - torch.cumsum(q_sorted, 0)
        total = p_at_or_above / p_sorted + q_below / q_sorted
        out.append(torch.where(both[order], 1.0 / total, 0.0).sum())
    return torch.stack(out)


def rows_for(args, zipf: float, sigma: float, temperature: float, top_k: int, top_p: float, gen):
    ranks = torch.arange(1, args.vocab + 1, dtype=torch.float64)
    logits = torch.empty(args.rows, args.vocab, dtype=torch.float64)
    for r in range(args.rows):
        logits[r, torch.randperm(args.vocab, generator=gen)] = -zipf * torch.log(ranks)
    draft = logits + sigma * torch.randn(logits.shape, generator=gen, dtype=torch.float64)
    params = [RowParams(temperature=temperature, top_k=top_k, top_p=top_p)] * args.rows
    return filtered_probs(logits.float(), params).double(), filtered_probs(draft.float(), params).double()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rows", type=int, default=32, help="distributions per setting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    settings = itertools.product(
        [1.0, 1.5],  # Zipf exponent of the target
        [0.0, 0.1, 0.3, 1.0],  # drafter noise σ
        [(0.8, -1, 1.0), (1.0, -1, 1.0), (0.8, 50, 1.0), (0.8, -1, 0.9)],  # temperature, top-k, top-p
    )
    table = Table(title=f"exact acceptance per draft, vocabulary {args.vocab}, mean of {args.rows} rows")
    for col in ("zipf", "σ", "T", "top-k", "top-p", "rejection", "coupled", "coupled / rejection", "gumbel"):
        table.add_column(col, justify="right")
    results = []
    for zipf, sigma, (temperature, top_k, top_p) in settings:
        p, q = rows_for(args, zipf, sigma, temperature, top_k, top_p, gen)
        rej = float(torch.minimum(p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)).sum(-1).mean())
        cpl = float(coupled_agreement(p, q).mean())
        gum = float(gumbel_agreement(p, q).mean())
        row = dict(
            zipf=zipf, sigma=sigma, temperature=temperature, top_k=top_k, top_p=top_p,
            rejection=rej, coupled=cpl, gumbel=gum,
        )  # fmt: skip
        results.append(row)
        table.add_row(
            f"{zipf}", f"{sigma}", f"{temperature}", str(top_k) if top_k > 0 else "-", f"{top_p}",
            f"{rej:.3f}", f"{cpl:.3f}", f"{cpl / rej:.2f}" if rej else "-", f"{gum:.3f}",
        )  # fmt: skip
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": args.vocab, "rows": args.rows, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
