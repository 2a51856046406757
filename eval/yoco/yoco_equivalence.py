#!/usr/bin/env python3
"""YOCO prefill truncation (SWA bounded replay) equivalence harness, two levels.

  l1  no weights, seconds: for many prompt lengths, chunkings and KEEP values, the consumer-layer
      metadata of `compact` equals that of `mask` on the kept rows (SWA pivots, visible key ranges,
      ring store slots, compressed key ranges), the kept rows are exactly the rule's suffix, every
      visible key is in the simulated W + B slot ring or computed in the chunk, a resume up to B
      tokens back finds all its keys, and a prompt at least as long resuming from a truncated state
      up to B tokens before its end (prefix-cache hit) reads no missing or stale key.
  l2  with weights (your checkpoint directory, or --make-tiny for the spec §11 tiny model): teacher-forced
      logprobs of a continuation after a truncated prefill, `mask` vs `compact` element by element (must
      be bit-identical on the kept rows) and vs `off` (reported: truncation is approximate by design,
      consumer SWA windows of the first ~W kept rows are clipped, see README); with draft blocks, the
      DSpark confidences `mask` vs `compact` bitwise.

Exit status 0 when every check holds (the vs-off difference is reported, never a failure).

  eval/yoco/yoco_equivalence.py l1 --window 128 --backtracking 6
  eval/yoco/yoco_equivalence.py l2 --checkpoint /models/deepseek-v41 --keep 140 --prompt-lens 512 2048
  eval/yoco/yoco_equivalence.py l2 --make-tiny /tmp/v41tiny --keep 14 --prompt-lens 64 200
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm


def _chunkings(n: int, rng: random.Random) -> list[tuple[str, list[int]]]:
    out = [("whole", [n])]
    for size in (1, 7, 64, 512, 8192):
        if size < n and n <= 64 * size:  # at most 64 chunks per walk keeps L1 within seconds
            out.append((f"chunks of {size}", [size] * (n // size) + ([n % size] if n % size else [])))
    cuts = sorted(rng.sample(range(1, n), min(5, n - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    out.append(("random", [b - a for a, b in zip(bounds, bounds[1:], strict=False)]))
    return out


def run_l1(args) -> int:
    from deepinfer_model.models.deepseek_v41.yoco_check import l1_check, l1_prefix_hit_check

    W, B = args.window, args.backtracking
    keeps = sorted({W + B, *args.keep})
    rng = random.Random(args.seed)
    lengths = sorted({1, 2, W - 1, W, W + B, 140, 141, 300, 1000, 4099, *args.prompt_lens} - {0})
    lengths += sorted(rng.sample(range(1, 20000), args.random_lengths))
    cases = [(n, name, ch, k) for n in lengths for name, ch in _chunkings(n, rng) for k in keeps]
    failures, records = 0, []
    for n, name, chunks, keep in tqdm(cases, desc="L1 cases", file=sys.stderr):
        problems = l1_check(n, chunks, keep, W, B)
        failures += bool(problems)
        records.append({"prompt_len": n, "chunking": name, "keep": keep, "problems": problems[:5]})
    # Prefix-cache hits / rollbacks: prompt B (len_b >= len_a) resumes from prompt A's truncated state.
    hits = [
        (n, h, nb, k)
        for n in lengths
        if 1 < n <= 5000
        for h in sorted({max(1, n - B), n - 1, n})  # a W + B slot ring serves resumes <= B back
        for nb in sorted({n, n + 1, n + W, 2 * n})
        if nb > h
        for k in keeps
    ]
    for n, h, nb, keep in tqdm(hits, desc="L1 prefix hits", file=sys.stderr):
        problems = l1_prefix_hit_check(n, [n], h, nb, [nb - h], keep, W, B)
        failures += bool(problems)
        records.append(
            {"prompt_len": nb, "chunking": f"hit {h} of {n}", "keep": keep, "problems": problems[:5]}
        )
    table = Table(title=f"L1 (W = {W}, B = {B}): compact vs mask metadata, chunked prefills and prefix hits")
    for c in ("KEEP", "cases", "failed"):
        table.add_column(c, justify="right")
    for keep in keeps:
        rs = [r for r in records if r["keep"] == keep]
        table.add_row(str(keep), str(len(rs)), str(sum(bool(r["problems"]) for r in rs)))
    Console().print(table)
    for r in [r for r in records if r["problems"]][:5]:
        print(f"FAIL prompt_len={r['prompt_len']} {r['chunking']} KEEP={r['keep']}: {r['problems'][0]}")
    _write(args.json, {"level": "l1", "window": W, "backtracking": B, "cases": records})
    print("L1", "PASS" if not failures else f"FAIL ({failures} cases)")
    return 1 if failures else 0


def run_l2(args) -> int:
    from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint, tiny_v41_config_dict
    from deepinfer_model.models.deepseek_v41.yoco_check import l2_compare

    path = args.checkpoint
    if args.make_tiny:
        cfg = tiny_v41_config_dict()
        cfg["text_config"]["max_position_embeddings"] = max(
            256, max(args.prompt_lens) + args.continuation_len
        )
        path = make_v41_checkpoint(args.make_tiny, cfg, seed=args.seed)
    if path is None:
        raise SystemExit("l2 needs --checkpoint DIR (or --make-tiny DIR)")
    act = torch.bfloat16 if args.engine_numerics else torch.float32
    model = load_v41(path, act_dtype=act, quantize_kv=args.engine_numerics)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    table = Table(
        title=f"L2 (KEEP = {args.keep}, {'BF16 + cache formats' if args.engine_numerics else 'FP32'})"
    )
    for c in (
        "prompt",
        "kept rows",
        "mask==compact",
        "draft conf ==",
        "max|Δlp| vs off",
        "mean|Δlp|",
        "argmax ==",
    ):
        table.add_column(c, justify="right")
    records, ok = [], True
    for n in tqdm(args.prompt_lens, desc="L2 prompts", file=sys.stderr):
        prompt = torch.randint(4, vocab, (n,), generator=gen)
        cont = torch.randint(4, vocab, (args.continuation_len,), generator=gen)
        rep = l2_compare(model, prompt, cont, args.keep, args.backtracking, args.num_draft_tokens)
        ok &= rep.ok
        conf = "-" if rep.draft_confidence_bitwise is None else str(rep.draft_confidence_bitwise)
        table.add_row(
            str(n),
            str(rep.kept_rows),
            str(rep.mask_vs_compact_bitwise and rep.continuation_bitwise),
            conf,
            f"{rep.max_abs_diff_vs_off:.3g}",
            f"{rep.mean_abs_diff_vs_off:.3g}",
            f"{rep.argmax_agree_vs_off:.1%}",
        )
        records.append({"prompt_len": n, **{k: v for k, v in vars(rep).items()}})
    Console().print(table)
    _write(args.json, {"level": "l2", "checkpoint": str(path), "keep": args.keep, "results": records})
    print(
        "L2", "PASS" if ok else "FAIL", "(mask vs compact bit-identical; the vs-off columns are informative)"
    )
    return 0 if ok else 1


def _write(path: Path | None, obj) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj, indent=1) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="level", required=True)
    l1 = sub.add_parser("l1", help="metadata equivalence, no weights")
    l1.add_argument("--window", type=int, default=128, help="sliding window W (V4.1: 128)")
    l1.add_argument(
        "--backtracking", type=int, default=6, help="max backtracking B (default 6 = 5 drafts + 1)"
    )
    l1.add_argument(
        "--keep", type=int, nargs="*", default=[140, 256, 1000], help="KEEP values (W + B always added)"
    )
    l1.add_argument("--prompt-lens", type=int, nargs="*", default=[], help="extra prompt lengths")
    l1.add_argument("--random-lengths", type=int, default=20, help="random prompt lengths added (default 20)")
    l1.add_argument("--seed", type=int, default=0)
    l1.add_argument("--json", type=Path, help="write every case to this JSON file")
    l2 = sub.add_parser("l2", help="teacher-forced logprob equivalence with weights")
    l2.add_argument("--checkpoint", type=Path, help="V4.1 checkpoint directory (config.json + safetensors)")
    l2.add_argument(
        "--make-tiny", type=Path, help="write the spec §11 tiny V4.1 (random weights) here and use it"
    )
    l2.add_argument("--keep", type=int, default=140, help="KEEP (default 140; the tiny model needs >= 14)")
    l2.add_argument("--backtracking", type=int, default=6, help="max backtracking B (default 6)")
    l2.add_argument(
        "--prompt-lens", type=int, nargs="+", default=[512], help="prompt lengths (random tokens)"
    )
    l2.add_argument("--continuation-len", type=int, default=16, help="teacher-forced continuation tokens")
    l2.add_argument("--num-draft-tokens", type=int, default=5, help="drafted tokens for the confidence check")
    l2.add_argument(
        "--engine-numerics", action="store_true", help="BF16 rounding points + FP8/FP4 cache formats"
    )
    l2.add_argument("--seed", type=int, default=0)
    l2.add_argument("--json", type=Path, help="write the per-prompt report to this JSON file")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    return run_l1(args) if args.level == "l1" else run_l2(args)


if __name__ == "__main__":
    sys.exit(main())
