"""The measurements of deepinfer-tiny's model card, from a checkpoint, its data, masters and training logs.

    uv run --no-sync python benchmarks/tiny/model_card.py --model CKPT --data DATA \\
        [--masters resume.safetensors] [--log train_log.json ...] [--baseline-model RANDOM_CKPT] [--quick]

Sections (each skipped, with the reason recorded, when its input is absent; each module's docstring
says exactly what it measures):

  heldout   held-out loss / PPL of the served model, a unigram baseline, loss by position, and the
            long-range ablation (the last tokens of each window with the full vs a cut context) [card_heldout]
  quant     held-out loss of the FP8 / FP4 checkpoint vs its BF16 masters (needs --masters)  [card_quant]
  code      share of greedy completions of held-out Python function headers that `ast` parses, for the
            model and --baseline-model                                                        [card_code]
  eval      Pass@1 on held-out arithmetic through deepinfer-eval generate / score / report     [card_eval]
  dspark    DSpark acceptance at nextn 1..5 (greedy, temperature 1, varlen) and the confidence head's
            calibration, from the engine's own statistics                                     [card_dspark]
  curves    training curves PNG and the runs' summary (needs --log)                           [card_curves]

Output (default benchmarks/out/tiny/, untracked): records.json (flat records, units in the key names;
`skipped` says which sections did not run and why), training_curves.png, code_completions.jsonl and the
eval stages' files. A table of the headline numbers is printed at the end. The model runs on --device
(default: the engine's, cuda when available) in the engine's default dtype and DEEPINFER_NUMERICS.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from card_common import Inputs, Records, read_config  # noqa: E402
from deepinfer_cluster import envs  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "out" / "tiny"
SECTIONS = ("heldout", "quant", "code", "eval", "dspark", "curves")
FULL = {
    "windows": 8,
    "window": 4096,
    "tail": 256,
    "quant_windows": 4,
    "code_prompts": 64,
    "code_tokens": 64,
    "eval_tasks": 100,
    "eval_tokens": 64,
    "dspark_prompts": 16,
    "dspark_tokens": 128,
}
QUICK = {
    "windows": 2,
    "window": 512,
    "tail": None,  # a quarter of the window
    "quant_windows": 1,
    "code_prompts": 4,
    "code_tokens": 24,
    "eval_tasks": 4,
    "eval_tokens": 32,
    "dspark_prompts": 2,
    "dspark_tokens": 8,
}
# The headline fields of each section's records in the final table.
HEADLINE = {
    "meta": ("device", "numerics", "quick"),
    "heldout": ("variant", "windows", "window_tokens", "loss_nats_per_token", "ppl"),
    "heldout_by_position": ("position_from", "position_to", "loss_nats_per_token"),
    "long_range": (
        "tail_tokens",
        "cut_context_tokens",
        "full_context_loss_nats_per_token",
        "cut_context_loss_nats_per_token",
        "gain_nats_per_token",
    ),  # fmt: skip
    "quantisation": ("checkpoint_loss_nats_per_token", "masters_loss_nats_per_token", "cost_nats_per_token"),
    "code": ("variant", "prompts", "parse_rate", "parse_with_body_rate", "ended_rate"),
    "eval": ("tasks", "pass_at_1", "ci95_low", "ci95_high", "chance_pass_at_1"),
    "dspark": (
        "nextn",
        "temperature",
        "varlen",
        "accept_rate",
        "accepted_tokens_per_step",
        "verified_len_mean",
        "confidence_ece",
        "same_tokens_as_first_greedy",
    ),  # fmt: skip
    "training": (
        "run",
        "steps",
        "tokens",
        "final_train_loss_nats_per_token",
        "final_heldout_loss_nats_per_token",
        "accepted_tokens_per_step",
    ),  # fmt: skip
    "dspark_reliability": (
        "nextn",
        "confidence_from",
        "confidence_to",
        "drafts",
        "confidence_mean",
        "accept_prob_mean",
    ),  # fmt: skip
    "timing": ("of", "seconds"),
}


def in_table(r: dict, rows: list[dict]) -> bool:
    """Every record but the reliability bins, which are shown for the largest nextn, greedy, fixed length."""
    if r["section"] != "dspark_reliability":
        return True
    top = max((x["nextn"] for x in rows if x["section"] == "dspark_reliability"), default=None)
    return r["nextn"] == top and r["temperature"] == 0.0 and not r["varlen"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="HF checkpoint folder: config.json, safetensors, tokenizer")
    p.add_argument(
        "--data",
        type=Path,
        help="recipe.data output: train.npy, heldout.npy, manifest.json, heldout_arithmetic.jsonl",
    )
    p.add_argument(
        "--log", type=Path, nargs="+", default=[], help="train_log.json files (base, resumed, drafter)"
    )
    p.add_argument("--masters", type=Path, help="resume.safetensors: BF16 masters of the quantised tensors")
    p.add_argument("--baseline-model", type=Path, help="a checkpoint to compare in the code section")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="small counts (CI): " + str(QUICK))
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument(
        "--device", help="cpu, cuda, cuda:N or auto (default: the engine's, $DEEPINFER_DEVICE / auto)"
    )
    g = p.add_argument_group("counts (default: the full run's, or --quick's)")
    g.add_argument("--windows", type=_positive, help=f"held-out windows (full {FULL['windows']})")
    g.add_argument(
        "--window", type=_positive, help="tokens per window, capped at the model's context (full 4096)"
    )
    g.add_argument(
        "--tail", type=_positive, help="targets of the long-range ablation (full 256; quick window / 4)"
    )
    g.add_argument("--cut", type=_positive, help="tokens of the cut context (default tail + sliding window)")
    g.add_argument(
        "--quant-windows", type=_positive, help="held-out windows of the quantisation cost (full 4)"
    )
    g.add_argument("--code-prompts", type=_positive, help="Python function prompts (full 64)")
    g.add_argument("--code-tokens", type=_positive, help="max new tokens per completion (full 64)")
    g.add_argument("--eval-tasks", type=_positive, help="held-out arithmetic tasks (full 100)")
    g.add_argument("--eval-tokens", type=_positive, help="max new tokens per eval answer (full 64)")
    g.add_argument("--dspark-prompts", type=_positive, help="prompts of the DSpark runs (full 16)")
    g.add_argument(
        "--dspark-tokens", type=_positive, help="new tokens per prompt in the DSpark runs (full 128)"
    )
    g.add_argument("--nextn", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="draft counts (1..5)")
    a = p.parse_args(argv)
    if any(not 1 <= n <= 5 for n in a.nextn):
        p.error(f"--nextn values must lie in 1..5, got {a.nextn}")
    return a


def resolve_inputs(a: argparse.Namespace) -> Inputs:
    counts = dict(QUICK if a.quick else FULL)
    for key in FULL:
        if getattr(a, key) is not None:
            counts[key] = getattr(a, key)
    counts["cut"] = a.cut
    counts["nextn"] = sorted(set(a.nextn))
    for name in ("model", "data", "masters", "baseline_model"):
        path = getattr(a, name)
        if path is not None and not path.exists():
            raise SystemExit(f"--{name.replace('_', '-')} {path} does not exist")
    for log in a.log:
        if not log.is_file():
            raise SystemExit(f"--log {log} is not a file")
    if a.model is not None and not (a.model / "config.json").is_file():
        raise SystemExit(f"--model {a.model} must be a checkpoint folder with config.json")
    a.out.mkdir(parents=True, exist_ok=True)
    return Inputs(a.model, a.data, a.log, a.masters, a.baseline_model, a.out, a.quick, a.device, counts)


def needs(inputs: Inputs, section: str) -> str | None:
    """Why `section` cannot run with these inputs (None: it can)."""
    required = {
        "heldout": ("model", "data"),
        "quant": ("model", "data", "masters"),
        "code": ("model", "data"),
        "eval": ("model", "data"),
        "dspark": ("model", "data"),
        "curves": ("logs",),
    }[section]
    missing = [f"--{'log' if r == 'logs' else r}" for r in required if not getattr(inputs, r)]
    if missing:
        return f"needs {' and '.join(missing)}"
    if section == "dspark" and not read_config(inputs.model).get("num_nextn_predict_layers"):
        return "the checkpoint has no DSpark draft blocks"
    if section == "eval" and not (inputs.data / "heldout_arithmetic.jsonl").is_file():
        return f"{inputs.data}/heldout_arithmetic.jsonl is missing"
    return None


def measure(inputs: Inputs, sections: list[str]) -> Records:
    """Run the chosen sections in order; their records (and skip reasons) in one `Records`."""
    from deepinfer_model import load_model, resolve_device

    records = Records()
    device = resolve_device(inputs.device, "--device")
    records.add(
        "meta",
        model=str(inputs.model),
        data=str(inputs.data),
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        numerics=envs.DEEPINFER_NUMERICS or "exact",
        dtype="float32",
        quick=inputs.quick,
        torch=torch.__version__,
    )
    engine_device = str(device)
    text = read_config(inputs.model) if inputs.model else {}
    heldout = prompts = None
    for section in SECTIONS:
        if section not in sections:
            continue
        why = needs(inputs, section)
        if why:
            records.skipped[section] = why
            continue
        t0 = time.perf_counter()
        if section == "heldout":
            import card_heldout

            served = load_model(inputs.model, torch.float32, device=device)  # what the engine loads
            heldout = card_heldout.run(served, inputs.data, records, inputs.counts, text)
            del served
        elif section == "quant":
            import card_heldout
            import card_quant

            heldout = heldout or card_heldout.windows_only(inputs.data, inputs.counts, text)
            card_quant.run(inputs.model, inputs.masters, heldout, records, inputs.counts, device)
        elif section == "code":
            import card_code

            models = {"model": inputs.model}
            if inputs.baseline_model:
                models["baseline"] = inputs.baseline_model
            prompts = card_code.run(models, inputs.data, records, inputs.counts, engine_device, inputs.out)
        elif section == "eval":
            import card_eval

            card_eval.run(
                inputs.model, inputs.data, records, inputs.counts, engine_device, inputs.out,
                text["max_position_embeddings"],
            )  # fmt: skip
        elif section == "dspark":
            import card_code
            import card_dspark

            if prompts is None:
                prompts = card_code.prompt_ids(inputs.model, inputs.data, inputs.counts["dspark_prompts"])
            if not prompts:
                records.skipped[section] = "no held-out code prompts"
                continue
            card_dspark.run(inputs.model, prompts, records, inputs.counts, engine_device)
        elif section == "curves":
            import card_curves

            card_curves.run(inputs.logs, records, inputs.out)
        records.add("timing", of=section, seconds=time.perf_counter() - t0)
    return records


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def print_table(records: Records, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="deepinfer-tiny model card measurements")
    for col in ("section", "measurements"):
        table.add_column(col)
    for r in (r for r in records.rows if in_table(r, records.rows)):
        keys = HEADLINE.get(r["section"], ())
        table.add_row(r["section"], "  ".join(f"{k}={_fmt(r.get(k))}" for k in keys if k in r))
    for section, why in records.skipped.items():
        table.add_row(section, f"skipped: {why}")
    console = Console(width=200)
    console.print(table)
    console.print(f"records: {out / 'records.json'}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    inputs = resolve_inputs(a)
    t0 = time.perf_counter()
    records = measure(inputs, a.sections)
    records.add("timing", of="total", seconds=time.perf_counter() - t0)
    records.write(inputs.out / "records.json")
    print_table(records, inputs.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
