"""The §11 tiny V4.1 model with its hot ops (RMSNorm, RoPE, mHC mixes/read/write) on the GPU vs the CPU reference.

The reference model still runs on the CPU (FP64 carrier); every call it makes through
`deepinfer_model.ops.model_calls` is sent to the NVIDIA op table (TileLang kernels) on CUDA and its
result brought back. This checks the kernels inside a real forward: teacher-forced logits close to the
CPU reference and greedy continuations that agree. (A fully device-resident forward needs the model's
own tensor allocations made device-aware; not done yet.)

    python benchmarks/gpu/check_model_ops_on_gpu.py --out benchmarks/results
writes `check_model_ops_on_gpu.json` (one record per activation dtype).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


class OnDevice:
    """Calls an op table's ops on `device`, with CPU tensors moved there and results moved back."""

    def __init__(self, table, device: str):
        self.table, self.device = table, device
        self.calls = 0

    def _to(self, x, dev):
        if isinstance(x, torch.Tensor):
            return x.to(dev)
        if isinstance(x, tuple):
            return tuple(self._to(v, dev) for v in x)
        return x

    def __getattr__(self, name):
        fn = self.table[name]

        def call(*args, **kwargs):
            self.calls += 1
            out = fn(*self._to(args, self.device), **{k: self._to(v, self.device) for k, v in kwargs.items()})
            return self._to(out, "cpu")

        return call


def greedy(model, prompt: torch.Tensor, steps: int) -> list[int]:
    ids = prompt.clone()
    for _ in range(steps):
        nxt = int(model.forward(ids).logits[-1].argmax())
        ids = torch.cat((ids, torch.tensor([nxt])))
    return ids[len(prompt) :].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    ap.add_argument("--tokens", type=int, default=48, help="teacher-forced sequence length")
    ap.add_argument("--steps", type=int, default=8, help="greedy steps")
    ap.add_argument("--backend", default="nvidia", help="op table the hot ops go to (cpu: self-check)")
    ap.add_argument("--device", default="cuda", help="device that table's ops run on")
    args = ap.parse_args()
    from deepinfer_model.backends import nvidia
    from deepinfer_model.models.deepseek_v41 import DeepseekV41ForCausalLM, load_v41, make_v41_checkpoint
    from deepinfer_model.ops import get_ops, model_calls

    torch.set_num_threads(4)
    v41 = load_v41(make_v41_checkpoint(tempfile.mkdtemp(), seed=0))
    ids = torch.randint(4, 256, (args.tokens,), generator=torch.Generator().manual_seed(1))
    on_gpu = OnDevice(get_ops(args.backend), args.device)
    cpu_ops_for = model_calls.ops_for
    recs = []
    for act in (torch.float32, torch.bfloat16):
        model = DeepseekV41ForCausalLM(
            v41.config, v41.weights, v41.engram.vocab, act_dtype=act, quantize_kv=False
        )
        t0 = time.monotonic()
        ref = model.forward(ids).logits.double()
        ref_greedy = greedy(model, ids[:16], args.steps)
        model_calls.ops_for = lambda x: on_gpu
        try:
            got = model.forward(ids).logits.double()
            got_greedy = greedy(model, ids[:16], args.steps)
        finally:
            model_calls.ops_for = cpu_ops_for
        rel = float((got - ref).norm() / ref.norm())
        top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        rec = dict(
            check="tiny_v41_hot_ops_on_gpu",
            act_dtype=str(act).removeprefix("torch."),
            tokens=args.tokens,
            logits_rel_err=rel,
            logits_max_abs_err=float((got - ref).abs().max()),
            teacher_forced_top1_agree=top1,
            greedy_steps=args.steps,
            greedy_agree=got_greedy == ref_greedy,
            gpu_op_calls=on_gpu.calls,
            tilelang_fallbacks=json.dumps(nvidia.TILELANG_FALLBACKS),
            sources=json.dumps(get_ops(args.backend).sources),
            wall_s=round(time.monotonic() - t0, 1),
        )
        print(rec, flush=True)
        recs.append(rec)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check_model_ops_on_gpu.json").write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
