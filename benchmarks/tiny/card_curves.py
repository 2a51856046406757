"""Section 6: training curves (PNG) and the training runs' summary, from the recipe's `train_log.json` files.

A base log (`recipe.train`: steps with `loss`, `indexer_kl`, `tokens`; evals with `heldout_loss`) may be
given several times over: a resumed run's log repeats the steps of the run it continued, so steps are
merged by step number, the later log winning. A drafter log (`recipe.train_drafter`: steps with `kl`,
`confidence_bce`, `acceptance`; a final eval) gets its own panel. Held-out evals are placed at the
token count of their step.
"""

from __future__ import annotations

import json
from pathlib import Path

from card_common import Records


def read_logs(paths: list[Path]) -> tuple[dict[int, dict], dict[int, float], list[dict], list[dict]]:
    """(base steps by step, base held-out loss by step, drafter logs, base runs)."""
    steps: dict[int, dict] = {}
    evals: dict[int, float] = {}
    drafters: list[dict] = []
    runs: list[dict] = []
    for path in paths:
        log = json.loads(Path(path).read_text())
        rows = log.get("steps", [])
        if rows and "confidence_bce" in rows[0]:
            drafters.append(log)
            continue
        if rows and "indexer_kl" not in rows[0]:
            raise ValueError(
                f"{path}: neither a base (indexer_kl) nor a drafter (confidence_bce) training log"
            )
        steps.update({r["step"]: r for r in rows})
        evals.update({e["step"]: e["heldout_loss"] for e in log.get("evals", [])})
        runs += [r for r in log.get("runs", []) if r not in runs]
    return steps, evals, drafters, runs


def plot(steps: dict[int, dict], evals: dict[int, float], drafters: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 + bool(drafters)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    order = sorted(steps)
    tokens = [steps[s]["tokens"] / 1e6 for s in order]
    ax = axes[0]
    ax.plot(tokens, [steps[s]["loss"] for s in order], lw=0.8, label="train loss")
    at = [s for s in sorted(evals) if s in steps]
    ax.plot([steps[s]["tokens"] / 1e6 for s in at], [evals[s] for s in at], "o-", label="held-out loss")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("nats / token")
    ax.set_title("base model")
    ax.legend()
    ax = axes[1]
    ax.plot(tokens, [steps[s]["indexer_kl"] for s in order], lw=0.8, color="tab:green")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("indexer KL (nats, summed over heads)")
    ax.set_title("lightning indexer vs main attention")
    if drafters:
        ax = axes[2]
        for i, log in enumerate(drafters):
            x = [r["step"] for r in log["steps"]]
            ax.plot(x, [r["kl"] for r in log["steps"]], lw=0.8, label=f"draft KL (run {i + 1})")
            ax.plot(
                x, [r["confidence_bce"] for r in log["steps"]], lw=0.8, label=f"confidence BCE (run {i + 1})"
            )
        ax.set_xlabel("drafter step")
        ax.set_ylabel("nats")
        ax.set_title("DSpark drafter")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(paths: list[Path], records: Records, out: Path) -> None:
    steps, evals, drafters, runs = read_logs(paths)
    if not steps and not drafters:
        records.skipped["training"] = "the logs hold no training steps"
        return
    png = out / "training_curves.png"
    plot(steps, evals, drafters, png)
    if steps:
        last = steps[max(steps)]
        records.add(
            "training",
            run="base",
            logs=len(paths) - len(drafters),
            steps=last["step"],
            tokens=last["tokens"],
            runs=len(runs),
            train_seconds=sum(r.get("seconds", 0.0) for r in runs),
            final_train_loss_nats_per_token=last["loss"],
            final_indexer_kl_nats=last["indexer_kl"],
            final_heldout_loss_nats_per_token=evals[max(evals)] if evals else None,
            curves_png=png.name,
        )
    for i, log in enumerate(drafters):
        final = log["evals"][-1] if log.get("evals") else {}
        per_position = {
            f"accept_rate_p{j + 1}": a for j, a in enumerate(final.get("acceptance_per_position", []))
        }
        records.add(
            "training",
            run=f"drafter_{i + 1}",
            steps=log["steps"][-1]["step"],
            train_seconds=log.get("seconds"),
            final_draft_kl_nats=final.get("kl"),
            **per_position,
            accepted_tokens_per_step=final.get("tokens_per_step"),
            confidence_abs_error_mean=final.get("confidence_abs_error_mean"),
            curves_png=png.name,
        )
