"""Train the DSpark drafter (draft blocks, Markov correction, confidence head) on the frozen base model.

    python -m deepinfer_tiny.recipe.train_drafter --data DATA --base CHECKPOINT --out OUT --deadline UNIX_TIME

Per sequence: the frozen base runs once (no gradient) and gives the drafter's target features and its
own next-token distributions. At random anchors `a` the drafter drafts a block after `g` = the token at
`a + 1`, exactly as `deepinfer_model`'s draft forward does at decode time (`drafter.draft_rows`, the
batched core of `draft_blocks`), with its main keys projected from the features (`drafter.main_keys`).
The Markov term is teacher-forced with the base's greedy tokens (what a verified draft prefix holds).
Losses: KL(base || draft) per draft position; the confidence head (on detached features) by binary
cross-entropy toward "the draft's greedy token equals the base's", i.e. its acceptance under greedy
verification given the earlier drafts were accepted (the scheduler multiplies the confidences).

The frozen base's stored values are made once for the run and the drafter's once per optimizer step
(`StepWeights`), shared by the step's sequences; `--reference-step` makes them all again per sequence (the
same losses and gradients, `tests/test_fast_step.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from deepinfer_model.training import (
    EXACT_KV,
    DeepseekV41ForCausalLM,
    confidence,
    draft_rows,
    key_layout,
    main_keys,
    numerics,
    round_to,
)

from .step_weights import StepWeights
from .train import LOG_FILE, forward_train, lr_at, windows
from .trainable import TrainableV41


def drafter_losses(
    tr: TrainableV41,
    ids: torch.Tensor,
    bd: int,
    anchors: int,
    act,
    rng: np.random.Generator,
    sw: StepWeights | None = None,
):
    """(KL loss, confidence BCE, per-position greedy acceptance [bd], mean confidence [bd], confidence minus
    acceptance per draft row) of one sequence. `sw`: the step's shared stored values (the frozen base's made
    once for the run, the drafter's once per optimizer step); None: the reference path, every stored value
    made again for this sequence."""
    cfg = tr.cfg
    W, T = cfg.sliding_window, ids.shape[0]
    with torch.no_grad():  # frozen backbone: no graph
        if sw is None:
            out, _ = forward_train(tr, ids, act, None, with_drafter=True)
        else:
            out = DeepseekV41ForCausalLM.forward.__wrapped__(sw.model, ids, return_trace=True)
        base_logp = torch.log_softmax(out.logits.float(), dim=-1)
        greedy = base_logp.argmax(dim=-1)  # greedy[p]: the base's token for position p + 1
    # (outside no_grad: the drafter's stored values carry their gradient)
    w = tr.weights(with_drafter=True) if sw is None else sw.weights
    positions = torch.arange(T, device=ids.device)
    keys = main_keys(cfg, w.drafter, out.features, positions, act)  # [Ld, T, D], with the drafter's graph
    a = torch.as_tensor(rng.integers(W - 1, T - bd - 1, size=anchors), device=ids.device)
    win = keys[:, a[:, None] - W + 1 + torch.arange(W, device=ids.device)[None, :]]  # [Ld, N, W, D]
    cols, visible = key_layout(a, W, W, bd, W + bd)
    steps = a[:, None] + 1 + torch.arange(bd, device=ids.device)[None, :]  # draft rows' positions [N, bd]
    teacher = greedy[steps]  # what each draft row should produce
    prev = torch.cat((ids[a + 1][:, None], teacher[:, :-1]), dim=1)  # Markov inputs: g, then teacher tokens
    temps = torch.ones(bd, device=ids.device)
    _tok, logits, _conf, hidden = draft_rows(
        cfg,
        w.drafter,
        w.embed,
        w.head,
        win,
        ids[a + 1],
        steps.reshape(-1),
        cols,
        visible,
        bd,
        lambda _logits, s: teacher[:, s],
        temps,
        act,
        EXACT_KV,
        None,
    )
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, bd, V]
    target = base_logp[steps]
    kl = (target.exp() * (target - logp)).sum(-1).mean()
    hit = (logits.argmax(-1) == teacher).float()
    e = round_to(w.drafter.markov.embed[prev], act)
    conf = (
        confidence(
            hidden.detach().reshape(-1, hidden.shape[-1]),
            e.detach().reshape(-1, e.shape[-1]),
            w.drafter.confidence_proj,
            1.0,
        )
        .view(hit.shape)
        .float()
    )
    bce = F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), hit)
    return kl, bce, hit.mean(0).detach(), conf.mean(0).detach(), (conf - hit).detach()


def drafter_step(
    tr: TrainableV41,
    sw: StepWeights | None,
    seqs: list[np.ndarray],
    a: argparse.Namespace,
    act,
    rng: np.random.Generator,
    device,
) -> torch.Tensor:
    """Forward and backward of each sequence of one optimizer step (the drafter masters' gradients of the
    mean loss); [mean KL, mean confidence BCE, last sequence's acceptance [bd], its confidence [bd]] as one
    device tensor, read on the host once per step."""
    if sw is not None:
        sw.refresh()
    sums = torch.zeros(2, device=device)
    for seq in seqs:
        ids = torch.as_tensor(seq.astype(np.int64), device=device)
        kl, bce, hit, conf, _ = drafter_losses(tr, ids, a.draft_len, a.anchors, act, rng, sw)
        ((kl + bce) / len(seqs)).backward()
        sums += torch.stack((kl, bce)).detach()
    if sw is not None:
        sw.push_grads()
    return torch.cat((sums / len(seqs), hit.float(), conf.float()))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument(
        "--base", required=True, help="the base checkpoint directory (config.json, shards, tokenizer)"
    )
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer-dir", required=True)
    p.add_argument("--deadline", type=float)
    p.add_argument("--save-reserve-s", type=float, default=20.0)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--anchors", type=int, default=256)
    p.add_argument("--draft-len", type=int, default=5)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--reference-step",
        action="store_true",
        help="make every stored value again per sequence (the slow reference path, for comparison)",
    )
    a = p.parse_args(argv)
    t_start = time.time()
    deadline = a.deadline or float("inf")
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    tr = TrainableV41.from_checkpoint(a.base, device)
    params = tr.train_only(tr.drafter_names())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    train = np.load(Path(a.data) / "train.npy", mmap_mode="r")
    held = windows(np.load(Path(a.data) / "heldout.npy", mmap_mode="r"), a.seq_len, 2, None)
    rng = np.random.default_rng(a.seed)
    act = torch.bfloat16
    sw = None if a.reference_step else StepWeights(tr, tr.drafter_names(), act, with_drafter=True)
    log = {"args": vars(a), "steps": [], "evals": []}
    planned, times, step = a.max_steps, [], 0
    with numerics.resolved():
        while (planned is None or step < planned) and not (
            times and time.time() + 1.5 * times[-1] + a.save_reserve_s > deadline
        ):
            t0 = time.time()
            lr = lr_at(step, planned or step + 1000, a.lr, a.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            stats = drafter_step(tr, sw, windows(train, a.seq_len, a.accum, rng), a, act, rng, device)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            values = stats.tolist()  # the step's one host read
            kl_mean, bce_mean = values[:2]
            hit, conf = values[2 : 2 + a.draft_len], values[2 + a.draft_len :]
            step += 1
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.time() - t0)
            row = {
                "step": step,
                "lr": lr,
                "kl": kl_mean,
                "confidence_bce": bce_mean,
                "acceptance": hit,
                "confidence": conf,
                "seconds": times[-1],
            }
            log["steps"].append(row)
            print(json.dumps(row), flush=True)
            if planned is None and deadline != float("inf") and len(times) == 4:
                planned = step + int(
                    (deadline - time.time() - a.save_reserve_s) / (sorted(times[1:])[1] * 1.08)
                )
                log["planned_steps"] = planned
        if sw is not None:
            sw.refresh()  # the drafter after the last optimizer step
        with torch.no_grad():
            evals = [
                drafter_losses(
                    tr,
                    torch.as_tensor(s.astype(np.int64), device=device),
                    a.draft_len,
                    a.anchors,
                    act,
                    np.random.default_rng(1),
                    sw,
                )
                for s in held
            ]
        acc = torch.stack([e[2] for e in evals]).mean(0)
        gaps = torch.cat([e[4].reshape(-1) for e in evals])
        log["evals"].append(
            {
                "step": step,
                "kl": float(sum(e[0] for e in evals) / len(evals)),
                "acceptance_per_position": acc.tolist(),
                # expected accepted drafts per step under greedy verification, plus the bonus token
                "tokens_per_step": float(1 + torch.cumprod(acc, 0).sum()),
                "confidence_abs_error_mean": float(gaps.abs().mean()),
            }
        )
    out = Path(a.out)
    tr.save_checkpoint(out / "checkpoint", a.tokenizer_dir)
    log["seconds"] = time.time() - t_start
    (out / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n")
    print(json.dumps(log["evals"][-1]), flush=True)
    return log


if __name__ == "__main__":
    # (as a program only: importing the recipe must not change the importing process's settings)
    os.environ.setdefault("DEEPINFER_NUMERICS", "native")
    os.environ.setdefault("DEEPINFER_ACCELERATOR", "cpu")
    main()
