"""Pareto plots (matplotlib PNG), one per phase, with the accounting and the roofline on the figure."""

from __future__ import annotations

from pathlib import Path

from .accounting import ACCOUNTING_TEXT
from .pareto import pareto_front
from .roofline import Ceilings, ModelCosts, decode_roof, prefill_roof


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(7.5, 5.2))


def _ceiling_text(ceil: Ceilings) -> str:
    return f"roofline: {ceil.device}, {ceil.tflops:.3g} TFLOP/s, {ceil.tbps:.3g} TB/s ({ceil.source})"


def plot_prefill(rows: list[dict], path: Path, ceil: Ceilings, costs: ModelCosts, title: str) -> Path:
    plt, fig, ax = _figure()
    xs = [r["chunk_latency_ms"] for r in rows]
    ys = [r["non_cached_tok_per_s_per_gpu"] for r in rows]
    ax.scatter(xs, ys, color="tab:blue", zorder=3, label="measured")
    for r, x, y in zip(rows, xs, ys):
        ax.annotate(f"{r['chunk_tokens']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = pareto_front(xs, ys, x_higher_is_better=False)
    ax.plot([xs[i] for i in front], [ys[i] for i in front], color="tab:blue", label="Pareto front")
    chunks = [r["chunk_tokens"] for r in rows]
    lo, hi = min(chunks), max(chunks)
    grid = sorted({int(lo * (hi / lo) ** (k / 40)) for k in range(41)}) if hi > lo else [lo]
    roof = [prefill_roof(costs, ceil, c) for c in grid]
    ax.plot([t * 1e3 for t, _ in roof], [v for _, v in roof], "--", color="tab:red", label="roofline")
    ax.set_xlabel("chunk latency (ms)")
    ax.set_ylabel("non-cached prompt tokens/s/GPU")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(title + "\nlabels: chunk tokens", fontsize=10)
    fig.text(0.01, 0.01, ACCOUNTING_TEXT["prefill"] + "\n" + _ceiling_text(ceil), fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_decode(
    rows: list[dict], path: Path, ceil: Ceilings, costs: ModelCosts, title: str, accounting: str = "full"
) -> Path:
    if accounting not in ("full", "measured"):
        raise ValueError(f"accounting must be 'full' or 'measured', got {accounting!r}")
    plt, fig, ax = _figure()
    key = "full_acceptance" if accounting == "full" else "measured"
    xs = [r[f"{key}_tok_per_s_per_user"] for r in rows]
    ys = [r[f"{key}_tok_per_s_per_gpu"] for r in rows]
    ax.scatter(xs, ys, color="tab:green", zorder=3, label=f"measured steps, {accounting} accounting")
    for r, x, y in zip(rows, xs, ys):
        ax.annotate(f"{r['batch']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = pareto_front(xs, ys, x_higher_is_better=True)
    ax.plot([xs[i] for i in front], [ys[i] for i in front], color="tab:green", label="Pareto front")
    if accounting == "full":  # the other accounting next to it, so the gap is visible
        mx = [r["measured_tok_per_s_per_user"] for r in rows]
        my = [r["measured_tok_per_s_per_gpu"] for r in rows]
        ax.scatter(mx, my, color="tab:gray", marker="x", label="measured acceptance")
    nextn = rows[0]["nextn"] if rows else 0
    batches = [r["batch"] for r in rows]
    hi = max(batches) * 2
    grid = sorted({max(1, int(hi ** (k / 40))) for k in range(41)})
    roof = [decode_roof(costs, ceil, b, nextn) for b in grid]
    ax.plot(
        [u for u, _ in roof], [g for _, g in roof], "--", color="tab:red", label="roofline (weights only)"
    )
    ax.set_xlabel("tokens/s/user")
    ax.set_ylabel("tokens/s/GPU")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(title + f"\nlabels: batch; nextn={nextn}", fontsize=10)
    fig.text(0.01, 0.01, ACCOUNTING_TEXT[accounting] + "\n" + _ceiling_text(ceil), fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
