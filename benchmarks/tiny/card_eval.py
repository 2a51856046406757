"""Section 4: Pass@1 on held-out synthetic arithmetic through `deepinfer-eval`'s own stages.

The first `count` tasks of `heldout_arithmetic.jsonl` (already in the task format `convert` writes:
AIME, an integer answer 0-999) go through `deepinfer-eval generate` (the AIME prompt in the checkpoint's
chat template, greedy: temperature 0, top-p 1, one sample per task, drafts off: greedy verification
emits the same tokens), `score` (`aime_score`: math-verify on the last `\\boxed{}`) and `report`
(Pass@1 with its clustered 95% interval), called as the command line calls them. Chance is 1/1000 (a
uniform guess of the integer). The stages' files stay in the output folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from card_common import Records

CHANCE = 1 / 1000


def run(model: Path, data: Path, records: Records, counts: dict, device, out: Path, context: int) -> None:
    from deepinfer.reproducibility import nextn_decode
    from deepinfer_eval.cli import main as eval_cli
    from deepinfer_eval.convert import read_tasks

    tasks, problems = read_tasks(data / "heldout_arithmetic.jsonl", "aime")
    if problems:
        raise ValueError(f"heldout_arithmetic.jsonl: {problems[0]}")
    tasks = tasks[: counts["eval_tasks"]]
    task_file, gens, scores, report = (
        out / f"eval_{n}" for n in ("tasks.jsonl", "generations.jsonl", "scores.jsonl", "report.json")
    )
    task_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    gens.unlink(missing_ok=True)  # generate resumes from an existing file: this run starts afresh
    engine = [f"max_model_len={min(context, 1024)}"] + ([f"device={device}"] if device else [])
    generate = [
        "generate",
        "--benchmark",
        "aime",
        "--tasks",
        str(task_file),
        "--samples",
        "1",
        "--model",
        str(model),
    ]
    generate += ["--output", str(gens), "--temperature", "0", "--top-p", "1"]
    generate += ["--max-tokens", str(counts["eval_tokens"])] + [
        x for e in engine for x in ("--engine-arg", e)
    ]
    with nextn_decode(0):
        for argv in (
            generate,
            ["score", "--generations", str(gens), "--output", str(scores)],
            [
                "report",
                "--scores",
                str(scores),
                "--tasks",
                str(task_file),
                "--samples",
                "1",
                "--output",
                str(report),
            ],
        ):
            if eval_cli(argv) != 0:
                raise RuntimeError(f"deepinfer-eval {argv[0]} failed")
    aime = json.loads(report.read_text())["benchmarks"]["aime"]
    records.add(
        "eval",
        benchmark="heldout_arithmetic",
        tasks=aime["tasks"],
        samples_per_task=aime["samples_per_task"],
        max_new_tokens=counts["eval_tokens"],
        pass_at_1=aime["pass_at_1"],
        ci95_low=aime["ci95_low"],
        ci95_high=aime["ci95_high"],
        samples_truncated=aime["samples_truncated"],
        chance_pass_at_1=CHANCE,
    )
