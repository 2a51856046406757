"""Host cost of a drafted step on the CPU: Python calls and host syncs of drafting and verification.

    uv run --no-sync python benchmarks/spec/profile_draft_host.py                  # batch 16, nextn 5
    uv run --no-sync python benchmarks/spec/profile_draft_host.py --batch 64 --label after

The engine runs the random-weight tiny V4.1 with the paged runner and the default drafter (the paged
DSpark drafter) over a batch of requests, half greedy and half sampled (top-p) unless --mix says
otherwise, synchronously. Around the two host-side halves of every drafted step, the drafter's proposal
(`SpecDecoder.propose`) and the verification (`verify_logits`: target distributions, accept / reject,
logprobs; the forward before it is not counted), it counts:

* python_calls: function calls that cProfile sees (Python functions and builtins, torch ops included);
* host_syncs: device-to-host reads (`.cpu()`, and `.item()`, `.tolist()`, `.numpy()`, `bool()` / `int()` /
  `float()` of a tensor that is not such a copy), through a torch function mode; on CUDA each one waits
  for the device (the eager MoE's expert counts among them);
* the calls of the functions the per-row draft sampling went through (`inverse_cdf`, `filtered_probs`).

Everything is reported per drafted step (a decode step that verified drafts), as a table and as flat JSON
records (units in the key names), appended to --out under --label (e.g. "before" / "after" a change).
The counts are the portable numbers; the milliseconds are of this CPU and this tiny model, measured with
the profiler attached (which inflates every call), so they are noisy and only comparable within one run.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch
from deepinfer import SamplingParams
from deepinfer.engine import worker as worker_module
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.spec_decode import verify_logits
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from rich.console import Console
from rich.table import Table
from torch.overrides import TorchFunctionMode

RESULTS = Path(__file__).resolve().parents[1] / "results" / "profile_draft_host.json"
WATCHED = ("inverse_cdf", "filtered_probs")


class HostSyncCounter(TorchFunctionMode):
    """Counts device-to-host reads: `.cpu()` calls, and reads of a tensor's values on the host (item,
    tolist, numpy, bool / int / float / index) of a tensor that is not the result of such a copy. On
    CUDA each of these waits for the device; on the CPU they mark where it would."""

    READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.host: set[int] = set()  # storages that a counted `.cpu()` returned

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name == "cpu":
            self.count += 1
            self.host.add(out.untyped_storage().data_ptr())
        elif name in self.READS and args and isinstance(args[0], torch.Tensor):
            if args[0].untyped_storage().data_ptr() not in self.host:
                self.count += 1
        return out


class Probe:
    """Wraps a callable: profiles and counts host syncs of every call; accumulates per name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.python_calls = 0
        self.host_syncs = 0
        self.watched = dict.fromkeys(WATCHED, 0)
        self.seconds = 0.0

    def wrap(self, fn):
        def probed(*args, **kwargs):
            prof, syncs = cProfile.Profile(), HostSyncCounter()
            t0 = time.perf_counter()
            with syncs:
                prof.enable()
                try:
                    return fn(*args, **kwargs)
                finally:
                    prof.disable()
                    self.seconds += time.perf_counter() - t0
                    self.calls += 1
                    self.host_syncs += syncs.count
                    stats = pstats.Stats(prof)
                    self.python_calls += stats.total_calls
                    for (_, _, func), (_, ncalls, *_rest) in stats.stats.items():
                        if func in self.watched:
                            self.watched[func] += ncalls

        return probed


def run(path: Path, args) -> dict:
    engine = LLMEngine(
        EngineArgs(model=str(path), block_size=16, max_model_len=256, disable_log_stats=True),
        num_speculative_tokens=args.nextn,
    )
    propose, verify = Probe("propose"), Probe("verify")
    engine.spec.propose = propose.wrap(engine.spec.propose)
    worker_module.verify_logits = verify.wrap(verify_logits)
    for i in range(args.batch):
        sampled = args.mix == "sampled" or (args.mix == "mixed" and i % 2 == 1)
        params = SamplingParams(
            temperature=0.8 if sampled else 0.0,
            top_p=0.9 if sampled else 1.0,
            seq_seed=100 + i,
            max_tokens=args.max_tokens,
            ignore_eos=True,
        )
        prompt = [(17 * i + 7 * j) % 256 for j in range(args.prompt_len)]
        engine.add_request(str(i), None, params, prompt_token_ids=prompt)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - start
    spec = engine.spec_stats() or {}
    engine.close()
    worker_module.verify_logits = verify_logits
    steps = max(propose.calls, 1)
    rec = {
        "bench": "profile_draft_host",
        "label": args.label,
        "batch": args.batch,
        "nextn": args.nextn,
        "mix": args.mix,
        "drafted_steps": propose.calls,
        "wall_s": wall,
        "propose_python_calls_per_step": propose.python_calls / steps,
        "propose_host_syncs_per_step": propose.host_syncs / steps,
        "propose_ms_per_step": 1e3 * propose.seconds / steps,
        "verify_python_calls_per_step": verify.python_calls / max(verify.calls, 1),
        "verify_host_syncs_per_step": verify.host_syncs / max(verify.calls, 1),
        "verify_ms_per_step": 1e3 * verify.seconds / max(verify.calls, 1),
        "mean_accepted_len_tokens": spec.get("avg_accepted_len", 0.0),
    }
    for name in WATCHED:
        rec[f"propose_{name}_calls_per_step"] = propose.watched[name] / steps
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--nextn", type=int, default=5)
    ap.add_argument("--mix", choices=["mixed", "sampled", "greedy"], default="mixed")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--label", default="current")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        rec = run(make_v41_checkpoint(Path(tmp) / "v41-tiny", seed=0), args)
    records = json.loads(args.out.read_text()) if args.out.exists() else []
    records = [
        r
        for r in records
        if (r["label"], r["batch"], r["nextn"], r["mix"]) != (args.label, args.batch, args.nextn, args.mix)
    ]
    records.append(rec)
    table = Table(title="host cost per drafted step (CPU, tiny V4.1, sync loop)")
    cols = ["label", "batch", "nextn", "mix"] + [k for k in rec if k.endswith("_per_step")]
    for c in cols:
        table.add_column(c.replace("_per_step", ""))
    for r in records:
        if (r["batch"], r["nextn"], r["mix"]) == (args.batch, args.nextn, args.mix):
            table.add_row(
                *(f"{r.get(c, 0):.4g}" if isinstance(r.get(c), float) else str(r.get(c)) for c in cols)
            )
    Console(width=240).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
