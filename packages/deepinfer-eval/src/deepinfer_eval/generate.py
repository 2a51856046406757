"""Generation stage: tasks -> one JSONL line per sample, resumable.

The engine is reached through a small ``Generator`` protocol, so the resume and bookkeeping logic
here does not depend on it; ``EngineGenerator`` adapts ``deepinfer.LLM`` (the optional extra
``deepinfer-eval[generate]``) and is the only place that imports the engine, lazily.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from deepinfer_eval.prompts import aime_prompt, gpqa_permutation, gpqa_prompt, hle_prompt, stable_seed
from deepinfer_eval.records import JsonlAppender, Problem, read_jsonl

Message = dict[str, str]


class Generator(Protocol):
    """Samples ``n`` responses for each chat conversation; ``seeds`` has one seed per conversation."""

    def generate(self, conversations: list[list[Message]], n: int, seeds: list[int]) -> list[list[str]]: ...


@dataclass
class SamplingConfig:
    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: int = 32768

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.max_tokens >= 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


class EngineGenerator:
    """``Generator`` on DeepInfer's public API: ``LLM.chat`` with ``SamplingParams(n=..., seq_seed=...)``."""

    def __init__(self, model: str, sampling: SamplingConfig, **llm_kwargs):
        try:
            from deepinfer import LLM, SamplingParams  # lazy: the engine is an optional extra
        except ImportError as e:
            raise ImportError(
                "the generate stage needs the engine: pip install 'deepinfer-eval[generate]'"
            ) from e
        self._params = SamplingParams
        self._sampling = sampling
        self._llm = LLM(model=model, **llm_kwargs)

    def generate(self, conversations, n, seeds):
        s = self._sampling
        params = [
            self._params(
                n=n, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, seq_seed=seed
            )
            for seed in seeds
        ]
        return [_texts(out) for out in self._llm.chat(conversations, params)]


def _texts(output) -> list[str]:
    """The sampled texts of one request's output (a RequestOutput with .outputs, or a string)."""
    if isinstance(output, str):
        return [output]
    return [completion.text for completion in output.outputs]


@dataclass
class Job:
    """One request: ``len(samples)`` samples of one prompt, written as one line each."""

    task: dict
    samples: list[int]
    prompt: str
    seed: int
    extra: dict  # per-line fields: gold answer and, for GPQA, the shuffle


@dataclass
class GenerationSummary:
    written: int = 0
    already_done: int = 0
    image_tasks_skipped: int = 0
    problems: list[Problem] = field(default_factory=list)


def plan_jobs(tasks: Sequence[dict], samples: int, seed: int, done: set[tuple[str, int]]) -> list[Job]:
    """Requests for the samples not yet in the output. AIME / HLE share one prompt per task (one
    request with n = missing samples); GPQA shuffles options per sample (one request per sample)."""
    jobs = []
    for task in tasks:
        missing = [s for s in range(samples) if (task["id"], s) not in done]
        if not missing:
            continue
        bench = task["benchmark"]
        if bench == "gpqa":
            for s in missing:
                perm = gpqa_permutation(seed, task["id"], s)
                prompt, gold = gpqa_prompt(task, perm)
                extra = {"answer": gold, "answer_type": "multipleChoice", "permutation": perm}
                jobs.append(Job(task, [s], prompt, stable_seed(seed, bench, task["id"], s), extra))
            continue
        if bench == "aime":
            prompt, extra = aime_prompt(task), {"answer": task["answer"], "answer_type": "integer"}
        elif bench == "hle":
            prompt = hle_prompt(task)
            extra = {
                "answer": task["answer"],
                "answer_type": task["answer_type"],
                "category": task.get("category", ""),
                "question": task["question"],
            }
        else:
            raise ValueError(f"benchmark must be one of aime, gpqa, hle; got {bench!r}")
        # the seed names the first missing sample, so a resumed run asks for exactly the same
        # request as an uninterrupted one whenever whole tasks were written
        jobs.append(Job(task, missing, prompt, stable_seed(seed, bench, task["id"], missing[0]), extra))
    return jobs


def _batches(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def run_generation(
    tasks: Sequence[dict],
    generator: Generator,
    output: str | os.PathLike,
    samples: int,
    seed: int = 0,
    batch_size: int = 64,
    sampling: SamplingConfig | None = None,
    progress: bool = True,
) -> GenerationSummary:
    """Generate the samples missing from ``output`` and append them, one flushed batch at a time."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    summary = GenerationSummary()
    benchmarks = {t["benchmark"] for t in tasks}
    done: set[tuple[str, int]] = set()
    skipped_before: set[str] = set()
    if os.path.exists(output):
        existing = read_jsonl(output, required=("benchmark", "id"))
        summary.problems = existing.problems
        for r in existing.records:
            if r["benchmark"] not in benchmarks:
                raise ValueError(
                    f"output {output} holds benchmark {r['benchmark']!r}, tasks are {sorted(benchmarks)}"
                )
            if r.get("skipped"):
                skipped_before.add(str(r["id"]))
            elif isinstance(r.get("sample"), int):
                done.add((str(r["id"]), r["sample"]))

    # The engine has no vision path yet: image tasks are recorded as skipped, never dropped.
    image_tasks = [t for t in tasks if t.get("image")]
    text_tasks = [t for t in tasks if not t.get("image")]
    summary.image_tasks_skipped = len(image_tasks)
    jobs = plan_jobs(text_tasks, samples, seed, done)
    summary.already_done = sum(1 for t in text_tasks for s in range(samples) if (t["id"], s) in done)

    from tqdm import tqdm

    sampling_record = vars(sampling) if sampling else None
    with (
        JsonlAppender(output) as out,
        tqdm(total=len(jobs), desc="generate", unit="req", disable=not progress) as bar,
    ):
        out.write(
            {
                "benchmark": t["benchmark"],
                "id": t["id"],
                "sample": None,
                "skipped": "image input (no vision path)",
                "category": t.get("category", ""),
            }
            for t in image_tasks
            if t["id"] not in skipped_before
        )
        for batch in _batches(jobs, batch_size):
            conversations = [[{"role": "user", "content": job.prompt}] for job in batch]
            # one request per job; jobs of one batch share n only when they miss equally many samples
            for n, group in _group_by_n(batch, conversations):
                responses = generator.generate([c for _, c in group], n, [job.seed for job, _ in group])
                if len(responses) != len(group):
                    raise RuntimeError(
                        f"generator returned {len(responses)} outputs for {len(group)} prompts"
                    )
                lines = []
                for (job, _), texts in zip(group, responses):
                    if len(texts) != n:
                        raise RuntimeError(f"generator returned {len(texts)} samples, asked for {n}")
                    for sample, text in zip(job.samples, texts):
                        record = {
                            "benchmark": job.task["benchmark"],
                            "id": job.task["id"],
                            "sample": sample,
                            "prompt": job.prompt,
                            "response": text,
                            **job.extra,
                            "seed": job.seed,
                        }
                        if sampling_record:
                            record["sampling"] = sampling_record
                        lines.append(record)
                out.write(lines)
                summary.written += len(lines)
                bar.update(len(group))
    return summary


def _group_by_n(batch: list[Job], conversations: list) -> list[tuple[int, list[tuple[Job, list]]]]:
    groups: dict[int, list] = {}
    for job, conv in zip(batch, conversations):
        groups.setdefault(len(job.samples), []).append((job, conv))
    return sorted(groups.items())
