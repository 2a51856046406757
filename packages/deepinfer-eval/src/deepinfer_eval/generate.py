"""Generation stage: tasks -> one JSONL line per sample, resumable.

The engine is reached through a small ``Generator`` protocol, so the resume and bookkeeping logic
here does not depend on it; ``EngineGenerator`` adapts ``deepinfer.LLM`` (the optional extra
``deepinfer-eval[generate]``) and is the only place that imports the engine, lazily.

Image tasks (HLE) are sent with their image: the user message's content becomes the prompt text followed
by an OpenAI-style `image_url` part holding the task's data URL, the order of HLE's own harness. Their
lines record the image's sha256 (`image_sha256`), not the image.

Seeds: sample s of a task always has seed ``task_seed + s`` (the engine's rule for sample i of a
request with ``n`` samples is ``seq_seed + i``), so a resumed run draws exactly the samples an
uninterrupted run would have drawn.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from deepinfer_eval.images import image_bytes
from deepinfer_eval.prompts import (
    aime_prompt,
    gpqa_permutation,
    gpqa_prompt,
    gpqa_shuffle_seed,
    hle_prompt,
    stable_seed,
)
from deepinfer_eval.records import JsonlAppender, Problem, read_jsonl

Message = dict  # {"role", "content"}: content a string, or a list of text / image_url parts


@dataclass
class Completion:
    """One sample. ``text`` is None when the request failed (``error`` says why). ``prompt_tokens``: the
    length of the prompt the engine ran (image positions included), when the generator knows it."""

    text: str | None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None


class Generator(Protocol):
    """Samples ``n`` responses for each chat conversation; ``seeds[j]`` is the seed of sample 0 of
    conversation j (sample i uses ``seeds[j] + i``). A sample may be a plain string. A message's content
    is a string, or for an image task a list of OpenAI-style parts: ``{"type": "text", "text": ...}`` then
    ``{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}``."""

    def generate(
        self, conversations: list[list[Message]], n: int, seeds: list[int]
    ) -> list[list[str | Completion]]: ...


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

    def __init__(self, model: str | None, sampling: SamplingConfig, **llm_kwargs):
        try:
            from deepinfer import LLM, SamplingParams  # lazy: the engine is an optional extra
        except ImportError as e:
            raise ImportError(
                "the generate stage needs the engine: pip install 'deepinfer-eval[generate]'"
            ) from e
        self._params = SamplingParams
        self._sampling = sampling
        self._llm = LLM(model=model, **llm_kwargs)
        self.max_model_len = int(self._llm.engine.max_model_len)
        self.notices: list[str] = []
        if sampling.max_tokens >= self.max_model_len:
            self.notices.append(
                f"max_tokens {sampling.max_tokens} does not fit the engine's context (max_model_len "
                f"{self.max_model_len}, prompt included): completions stop at the context, recorded as "
                f"finish_reason 'context' (raise it with --engine-arg max_model_len=N up to the model's limit)"
            )

    def generate(self, conversations, n, seeds):
        s = self._sampling
        params = [
            self._params(
                n=n, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, seq_seed=seed
            )
            for seed in seeds
        ]
        outs = self._llm.chat(conversations, params, raise_on_error=False)
        return [_completions(out, n, s.max_tokens, self.max_model_len) for out in outs]

    def close(self) -> None:
        self._llm.close()


def _completions(output, n: int, max_tokens: int, max_model_len: int) -> list[Completion]:
    """The samples of one engine ``RequestOutput``; a failed request gives n failed samples. A sample
    the engine stopped at the context before max_tokens gets finish_reason "context", not "length"."""
    if getattr(output, "error", None):
        return [Completion(None, "error", output.error)] * n
    prompt_len = len(output.prompt_token_ids)  # with images: their expanded positions included
    out = []
    for c in output.outputs:
        reason = getattr(c, "finish_reason", None)
        if (
            reason == "length"
            and len(c.token_ids) < max_tokens
            and prompt_len + len(c.token_ids) >= max_model_len
        ):
            reason = "context"
        out.append(Completion(c.text, reason, prompt_tokens=prompt_len))
    return out


@dataclass
class Job:
    """One request: consecutive samples ``samples`` of one prompt, seeds ``seed + i``."""

    task: dict
    samples: list[int]
    prompt: str
    seed: int
    extra: dict  # per-line fields: gold answer and, for GPQA, the shuffle
    image: str = ""  # the task's image as a data URL (HLE image tasks)
    error: str | None = None  # the task cannot be sent (its image does not decode): samples fail with this

    def conversation(self) -> list[Message]:
        if not self.image:
            return [{"role": "user", "content": self.prompt}]
        parts = [
            {"type": "text", "text": self.prompt},
            {"type": "image_url", "image_url": {"url": self.image}},
        ]
        return [{"role": "user", "content": parts}]


@dataclass
class GenerationSummary:
    written: int = 0
    already_done: int = 0
    failed: int = 0  # samples written with an error instead of a response (they score as wrong)
    image_tasks: int = 0  # tasks sent with their image
    image_tasks_skipped: int = 0  # with skip_image_tasks
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # e.g. a resume whose parameters changed


def _runs(samples: list[int]) -> list[list[int]]:
    """[0, 1, 2, 5, 6] -> [[0, 1, 2], [5, 6]]: one request per run of consecutive samples."""
    runs: list[list[int]] = []
    for s in samples:
        if runs and runs[-1][-1] == s - 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def plan_jobs(tasks: Sequence[dict], samples: int, seed: int, done: set[tuple[str, int]]) -> list[Job]:
    """Requests for the samples not yet in the output. AIME / HLE share one prompt per task (one
    request with n = missing samples); GPQA shuffles options per sample (one request per sample)."""
    jobs = []
    for task in tasks:
        missing = [s for s in range(samples) if (task["id"], s) not in done]
        if not missing:
            continue
        bench = task["benchmark"]
        task_seed = stable_seed(seed, bench, task["id"])
        if bench == "gpqa":
            for s in missing:
                perm = gpqa_permutation(seed, task["id"], s)
                prompt, gold = gpqa_prompt(task, perm)
                extra = {
                    "answer": gold,
                    "answer_type": "multipleChoice",
                    "permutation": perm,
                    "shuffle_seed": gpqa_shuffle_seed(seed, task["id"], s),
                    "category": task.get("category", ""),
                }
                jobs.append(Job(task, [s], prompt, task_seed + s, extra))
            continue
        image, error = "", None
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
            image = task.get("image") or ""
            if image:
                try:
                    extra["image_sha256"] = hashlib.sha256(
                        image_bytes(image, f"task {task['id']!r}: field 'image'")
                    ).hexdigest()
                except ValueError as e:
                    error = str(e)
        else:
            raise ValueError(f"benchmark must be one of aime, gpqa, hle; got {bench!r}")
        jobs.extend(Job(task, run, prompt, task_seed + run[0], extra, image, error) for run in _runs(missing))
    return jobs


def _batches(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _read_done(
    output, benchmarks: set[str], summary: GenerationSummary, seed: int, sampling: SamplingConfig | None
) -> tuple[set, set]:
    done: set[tuple[str, int]] = set()
    skipped: set[str] = set()
    if not os.path.exists(output):
        return done, skipped
    changed: dict[str, tuple[int, object, object]] = {}  # what -> (lines, first old value, new value)
    existing = read_jsonl(output, required=("benchmark", "id"))
    summary.problems = existing.problems
    for r in existing.records:
        if r["benchmark"] not in benchmarks:
            raise ValueError(
                f"output {output} holds benchmark {r['benchmark']!r}, the tasks are {sorted(benchmarks)}"
            )
        if r.get("skipped"):
            skipped.add(str(r["id"]))
        elif isinstance(r.get("sample"), int):
            done.add((str(r["id"]), r["sample"]))
            _note_changes(r, seed, sampling, changed)
    for what, (count, old, new) in changed.items():
        summary.warnings.append(
            f"resuming {output}: {count} existing sample(s) were generated with {what} {old!r}, this run "
            f"uses {new!r}; the file now mixes both (use a new --output to keep runs apart)"
        )
    return done, skipped


def _note_changes(record: dict, seed: int, sampling: SamplingConfig | None, changed: dict) -> None:
    """Compare one existing line with this run's parameters: the seed it would get now, and the
    sampling settings it records."""
    expected = stable_seed(seed, record["benchmark"], record["id"]) + record["sample"]
    found = {}
    if isinstance(record.get("seed"), int) and record["seed"] != expected:
        found["seed (from --seed)"] = (record["seed"], expected)
    old = record.get("sampling")
    if sampling is not None and isinstance(old, dict):
        for key, new in vars(sampling).items():
            if key in old and old[key] != new:
                found[key] = (old[key], new)
    for what, (old_value, new_value) in found.items():
        count, first, _ = changed.get(what, (0, old_value, new_value))
        changed[what] = (count + 1, first, new_value)


def run_generation(
    tasks: Sequence[dict],
    generator: Generator,
    output: str | os.PathLike,
    samples: int,
    seed: int = 0,
    batch_size: int = 64,
    sampling: SamplingConfig | None = None,
    progress: bool = True,
    skip_image_tasks: bool = False,
) -> GenerationSummary:
    """Generate the samples missing from ``output`` and append them, one flushed batch at a time.
    Image tasks go to the generator with their image; ``skip_image_tasks`` (a model without a vision
    tower) records each of them once as skipped instead, and the report leaves them out of Pass@1."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    summary = GenerationSummary()
    done, skipped_before = _read_done(output, {t["benchmark"] for t in tasks}, summary, seed, sampling)
    summary.warnings.extend(getattr(generator, "notices", []))

    skipped_tasks = [t for t in tasks if t.get("image")] if skip_image_tasks else []
    sent = [t for t in tasks if not (skip_image_tasks and t.get("image"))]
    summary.image_tasks_skipped = len(skipped_tasks)
    summary.image_tasks = sum(1 for t in sent if t.get("image"))
    jobs = plan_jobs(sent, samples, seed, done)
    summary.already_done = sum(1 for t in sent for s in range(samples) if (t["id"], s) in done)
    unsendable = [job for job in jobs if job.error is not None]
    jobs = [job for job in jobs if job.error is None]
    for job in unsendable:
        summary.warnings.append(f"{job.error}: its {len(job.samples)} sample(s) are written as failed")

    from tqdm import tqdm

    todo = sum(len(job.samples) for job in jobs)
    with (
        JsonlAppender(output) as out,
        tqdm(total=todo, desc="samples written", unit="sample", disable=not progress) as bar,
    ):
        out.write(
            {
                "benchmark": t["benchmark"],
                "id": t["id"],
                "sample": None,
                "skipped": "image input (--skip-image-tasks)",
                "category": t.get("category", ""),
            }
            for t in skipped_tasks
            if t["id"] not in skipped_before
        )
        for job in unsendable:
            n = len(job.samples)
            lines = _lines(job, [Completion(None, "error", job.error)] * n, n, sampling)
            out.write(lines)
            summary.written += len(lines)
            summary.failed += len(lines)
            bar.update(len(lines))
        for batch in _batches(jobs, batch_size):
            for n, group in _group_by_n(batch):  # one engine call per sample count
                conversations = [job.conversation() for job in group]
                responses = generator.generate(conversations, n, [job.seed for job in group])
                if len(responses) != len(group):
                    raise RuntimeError(
                        f"generator returned {len(responses)} outputs for {len(group)} prompts"
                    )
                lines = [line for job, got in zip(group, responses) for line in _lines(job, got, n, sampling)]
                out.write(lines)
                summary.written += len(lines)
                summary.failed += sum(1 for line in lines if line["response"] is None)
                bar.update(len(lines))
    return summary


def _lines(job: Job, got: list, n: int, sampling: SamplingConfig | None) -> list[dict]:
    if len(got) != n:
        raise RuntimeError(
            f"generator returned {len(got)} samples for task {job.task['id']!r}, asked for {n}"
        )
    lines = []
    for i, (sample, c) in enumerate(zip(job.samples, got)):
        c = c if isinstance(c, Completion) else Completion(c)
        record = {
            "benchmark": job.task["benchmark"],
            "id": job.task["id"],
            "sample": sample,
            "prompt": job.prompt,
            "response": c.text,
            **job.extra,
            "seed": job.seed + i,
        }
        if c.finish_reason is not None:
            record["finish_reason"] = c.finish_reason
        if c.error is not None:
            record["error"] = c.error
        if c.prompt_tokens is not None:
            record["prompt_tokens"] = c.prompt_tokens
        if sampling is not None:
            record["sampling"] = vars(sampling)
        lines.append(record)
    return lines


def _group_by_n(batch: list[Job]) -> list[tuple[int, list[Job]]]:
    groups: dict[int, list[Job]] = {}
    for job in batch:
        groups.setdefault(len(job.samples), []).append(job)
    return sorted(groups.items())
