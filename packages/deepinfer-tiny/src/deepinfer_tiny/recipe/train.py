"""Train deepinfer-tiny's base model under a wall-clock budget, with `deepinfer_model`'s own V4.1 forward.

    python -m deepinfer_tiny.recipe.train --data DATA --out OUT --deadline UNIX_TIME [--resume OUT_OF_A_RUN]

Numerics: `DEEPINFER_NUMERICS=native` with BF16 activations (the engine's rounding points; BF16 GEMMs
with FP32 accumulation) on the registry's torch reference ops (`DEEPINFER_ACCELERATOR=cpu`, on any
device: differentiable, unlike the inference kernels). Weights are trained quantisation-aware
(`trainable.stored_value`). Each optimizer step accumulates `--accum` sequences of `--seq-len` tokens.

The step count is planned from the measured step time so the cosine schedule ends at the deadline; the
run saves and stops before it. `OUT` then holds `checkpoint/` (HF format, what the loader reads),
`resume.safetensors` (BF16 masters of every tensor the checkpoint stores quantised, and the step state)
and `train_log.json` (loss curve, held-out evals, plan). `--resume` continues from such a directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from deepinfer_model.training import (
    CompressedVocabulary,
    DeepseekV41ForCausalLM,
    numerics,
)
from safetensors.torch import load_file, save_file

from ..architecture import micro_config_dict, tiny_config_dict
from .losses import BalancedMoE, indexer_kl, next_token_loss
from .step_weights import StepWeights
from .trainable import TrainableV41

RESUME_FILE = "resume.safetensors"
LOG_FILE = "train_log.json"
# Stored BF16 in the checkpoint already (exact there): not repeated in the resume file.
_BF16_IN_CHECKPOINT = ("embed.weight", "head.weight")


def forward_train(
    tr: TrainableV41,
    ids: torch.Tensor,
    act: torch.dtype,
    balance: BalancedMoE | None,
    with_drafter: bool = False,
):
    """One teacher-forced forward of `ids` through the library model: (out, model)."""
    model = tr.model(act, with_drafter=with_drafter, moe_fn=balance)
    # (the library forward is decorated with no_grad for inference; training calls the function itself)
    out = DeepseekV41ForCausalLM.forward.__wrapped__(model, ids, return_trace=True)
    return out, model


def sequence_losses(tr: TrainableV41, ids: torch.Tensor, act: torch.dtype, balance: BalancedMoE):
    out, model = forward_train(tr, ids, act, balance)
    lm = next_token_loss(out.logits, ids)
    kl = indexer_kl(tr.cfg, model.weights, out.trace, act)
    return lm, kl, balance.balance_loss().to(lm.device)


def step_losses(sw: StepWeights, ids: torch.Tensor, act: torch.dtype, balance: BalancedMoE):
    """`sequence_losses` on the step's shared stored values (`StepWeights`): the same losses and gradients."""
    out = DeepseekV41ForCausalLM.forward.__wrapped__(sw.model, ids, return_trace=True)
    lm = next_token_loss(out.logits, ids)
    kl = indexer_kl(sw.tr.cfg, sw.weights, out.trace, act)
    return lm, kl, balance.balance_loss().to(lm.device)


def accumulate(
    tr: TrainableV41,
    sw: StepWeights | None,
    seqs: list[np.ndarray],
    act: torch.dtype,
    balance: BalancedMoE,
    kl_weight: float,
    balance_weight: float,
) -> torch.Tensor:
    """Forward and backward of each sequence of one optimizer step: the masters' gradients of the mean
    weighted loss, and the mean (next-token loss, indexer KL, balance) as a device tensor [3] (read on the
    host once per step, not per sequence). `sw` None: the reference path (`sequence_losses`, stored values
    made per sequence); else the step's shared stored values (`step_losses`)."""
    device = tr.masters["embed.weight"].device
    batch = torch.as_tensor(np.stack(seqs).astype(np.int64)).to(device, non_blocking=True)
    if sw is not None:
        sw.refresh()
    parts = torch.zeros(3, device=device)
    for ids in batch:
        losses = sequence_losses if sw is None else step_losses
        lm, kl, bal = losses(tr if sw is None else sw, ids, act, balance)
        ((lm + kl_weight * kl + balance_weight * bal) / len(seqs)).backward()
        parts += torch.stack((lm, kl, bal)).detach()
    if sw is not None:
        sw.push_grads()
    return parts / len(seqs)


def optimizer_step(
    tr: TrainableV41,
    sw: StepWeights | None,
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    seqs: list[np.ndarray],
    act: torch.dtype,
    balance: BalancedMoE,
    a: argparse.Namespace,
) -> torch.Tensor:
    """One optimizer step on `seqs`: [mean loss, indexer KL, balance, gradient norm] as a device tensor."""
    parts = accumulate(tr, sw, seqs, act, balance, a.kl_weight, a.balance_weight)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    balance.update_biases(tr.masters, a.bias_rate)
    return torch.cat((parts, grad_norm.reshape(1).to(parts.device)))


def windows(stream: np.ndarray, length: int, count: int, rng: np.random.Generator | None) -> list[np.ndarray]:
    """`count` windows of `length` tokens: random starts (training) or evenly spaced (held-out, rng None)."""
    if stream.size < length:
        raise ValueError(f"a stream of {stream.size} tokens is shorter than one window of {length}")
    if rng is None:
        starts = np.linspace(0, stream.size - length, count).astype(np.int64)
    else:
        starts = rng.integers(0, stream.size - length + 1, size=count)
    return [stream[s : s + length] for s in starts]


@torch.no_grad()
def heldout_loss(tr: TrainableV41, seqs: list[np.ndarray], act: torch.dtype, device) -> float:
    total = 0.0
    for s in seqs:
        ids = torch.as_tensor(s.astype(np.int64), device=device)
        out, _ = forward_train(tr, ids, act, None)
        total += float(next_token_loss(out.logits, ids))
    return total / len(seqs)


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def _decays(name: str, t: torch.Tensor) -> bool:
    return t.dim() >= 2 and "hc_" not in name


def backbone_optimizer(
    tr: TrainableV41, lr: float, weight_decay: float
) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    """Train the backbone (the drafter frozen): its tensors, and AdamW with decay on the matrices."""
    params = tr.train_only(tr.backbone_names())
    named = [(n, tr.masters[n]) for n in tr.backbone_names()]
    groups = [
        {"params": [t for n, t in named if _decays(n, t)], "weight_decay": weight_decay},
        {"params": [t for n, t in named if not _decays(n, t)], "weight_decay": 0.0},
    ]
    return params, torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def save_run(tr: TrainableV41, out: Path, tokenizer_dir: Path, state: dict, log: dict) -> None:
    """Write the run into `out/.saving`, then move each part into place: a run killed while saving keeps
    its previous save whole."""
    staging = out / ".saving"
    shutil.rmtree(staging, ignore_errors=True)
    tr.save_checkpoint(staging / "checkpoint", tokenizer_dir)
    masters = {
        n: t.detach().to(torch.bfloat16).cpu().contiguous()
        for n, t in tr.masters.items()
        if n not in _BF16_IN_CHECKPOINT and tr.layout[n].kind not in ("float", "f32")
    }
    save_file(masters, staging / RESUME_FILE, metadata={"state": json.dumps(state, default=int)})
    (staging / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n")
    shutil.rmtree(out / "checkpoint", ignore_errors=True)
    for name in ("checkpoint", RESUME_FILE, LOG_FILE):
        os.replace(staging / name, out / name)
    staging.rmdir()


def load_run(path: Path, device) -> tuple[TrainableV41, dict, dict]:
    tr = TrainableV41.from_checkpoint(path / "checkpoint", device)
    from safetensors import safe_open

    with safe_open(str(path / RESUME_FILE), "pt") as f:
        state = json.loads(f.metadata()["state"])
    for name, t in load_file(str(path / RESUME_FILE), device=str(device)).items():
        tr.masters[name] = t.float()
    log = json.loads((path / LOG_FILE).read_text())
    return tr, state, log


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="directory of recipe.data: train.npy, heldout.npy")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer-dir", required=True, help="tokenizer.json + tokenizer_config.json")
    p.add_argument("--resume", help="an --out directory of an earlier run")
    p.add_argument("--deadline", type=float, help="unix time by which the run has saved")
    p.add_argument("--budget-s", type=float, default=None, help="instead of --deadline: seconds from start")
    p.add_argument("--save-reserve-s", type=float, default=25.0, help="time kept for the final eval and save")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--balance-weight", type=float, default=1e-3)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-seqs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--save-every-s", type=float, default=None, help="also save the run this often (a killed run resumes)"
    )
    p.add_argument("--micro", action="store_true", help="the test-sized config (CPU verification)")
    p.add_argument(
        "--reference-step",
        action="store_true",
        help="quantise every tensor per sequence (the slow reference of the shared per-step stored values)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    t_start = time.time()
    deadline = a.deadline or (t_start + a.budget_s if a.budget_s else float("inf"))
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    tok_dir = Path(a.tokenizer_dir)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    act = torch.bfloat16
    if a.resume:
        tr, state, log = load_run(Path(a.resume), device)
    else:
        config = micro_config_dict() if a.micro else tiny_config_dict()
        vocab = CompressedVocabulary.from_file(tok_dir)
        tr = TrainableV41.initialise(config, vocab, a.seed, device)
        state = {"step": 0, "tokens": 0, "rng": a.seed}
        log = {"config": tr.config, "args": vars(a), "steps": [], "evals": [], "runs": []}
    params, opt = backbone_optimizer(tr, a.lr, a.weight_decay)
    train = np.load(Path(a.data) / "train.npy", mmap_mode="r")
    held = windows(np.load(Path(a.data) / "heldout.npy", mmap_mode="r"), a.seq_len, a.eval_seqs, None)
    rng = np.random.default_rng(state["rng"] + state["step"])  # a resumed run draws new windows
    balance = BalancedMoE(tr.cfg, act)
    sw = None if a.reference_step else StepWeights(tr, tr.backbone_names(), act, moe_fn=balance)
    first_step = state["step"]
    planned = a.max_steps
    step_times: list[float] = []
    run = {"start_step": first_step, "device": str(device), "started": t_start}
    last_save = time.time()
    with numerics.resolved():
        while True:
            step = state["step"]
            if planned is not None and step >= planned:
                break
            if step_times and time.time() + 1.5 * step_times[-1] + a.save_reserve_s > deadline:
                break
            t0 = time.time()
            total = planned if planned is not None else step + 1000
            lr = lr_at(
                step - first_step, total - first_step, a.lr, a.warmup
            )  # (a resumed run warms up again)
            for g in opt.param_groups:
                g["lr"] = lr
            seqs = windows(train, a.seq_len, a.accum, rng)
            lm, kl, bal, grad_norm = optimizer_step(tr, sw, opt, params, seqs, act, balance, a).tolist()
            state["step"] += 1
            state["tokens"] += a.accum * a.seq_len
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.time() - t0)
            log["steps"].append(
                {
                    "step": state["step"],
                    "tokens": state["tokens"],
                    "lr": lr,
                    "loss": lm,
                    "indexer_kl": kl,
                    "balance": bal,
                    "grad_norm": grad_norm,
                    "seconds": step_times[-1],
                }
            )
            if planned is None and deadline != float("inf") and len(step_times) == 4:
                per = sorted(step_times[1:])[1]  # (the first step includes warm-up work)
                planned = state["step"] + int((deadline - time.time() - a.save_reserve_s) / (per * 1.08))
                run["planned_steps"] = planned
                run["step_seconds"] = per
            if state["step"] % a.eval_every == 0:
                log["evals"].append(
                    {"step": state["step"], "heldout_loss": heldout_loss(tr, held, act, device)}
                )
            print(json.dumps(log["steps"][-1]), flush=True)
            if a.save_every_s and time.time() - last_save > a.save_every_s:
                partial = dict(
                    run, end_step=state["step"], seconds=time.time() - t_start, tokens=state["tokens"]
                )
                save_run(tr, out, tok_dir, state, {**log, "runs": [*log["runs"], partial]})
                last_save = time.time()
        log["evals"].append({"step": state["step"], "heldout_loss": heldout_loss(tr, held, act, device)})
    state["rng"] = int(state["rng"])
    run.update(end_step=state["step"], seconds=time.time() - t_start, tokens=state["tokens"])
    log["runs"].append(run)
    save_run(tr, out, tok_dir, state, log)
    print(json.dumps({"final": log["evals"][-1], "run": run}), flush=True)
    return log


if __name__ == "__main__":
    # (as a program only: importing the recipe must not change the importing process's settings)
    os.environ.setdefault("DEEPINFER_NUMERICS", "native")
    os.environ.setdefault("DEEPINFER_ACCELERATOR", "cpu")
    main()
