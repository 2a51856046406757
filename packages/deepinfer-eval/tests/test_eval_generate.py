"""Generation stage: output lines, GPQA shuffles, HLE image tasks and resume after a crash.

The engine is not involved: ``SumGenerator`` is a real (if simple) Generator that solves the
"Compute a + b." problems of the fixtures, so the bookkeeping is tested end to end.
"""

import json
import random
import re

import pytest
from deepinfer_eval import Completion, read_jsonl, run_generation, score_records
from deepinfer_eval.prompts import gpqa_permutation


class SumGenerator:
    """Answers "Compute a + b." correctly for even sample seeds, off by one for odd ones."""

    def __init__(self, fail_after_calls: int | None = None):
        self.calls, self.requests, self.fail_after_calls = 0, 0, fail_after_calls

    def generate(self, conversations, n, seeds):
        if self.fail_after_calls is not None and self.calls >= self.fail_after_calls:
            raise RuntimeError("simulated crash")
        self.calls += 1
        self.requests += len(conversations)
        out = []
        for conv, seed in zip(conversations, seeds):
            a, b = map(int, re.search(r"Compute (\d+) \+ (\d+)", conv[-1]["content"]).groups())
            # sample i has seed seed + i (the Generator contract); the answer depends on that seed
            out.append(
                [
                    f"<think>{a}+{b}, seed {seed + i}</think>\\boxed{{{a + b + (seed + i) % 2}}}"
                    for i in range(n)
                ]
            )
        return out


def _aime_tasks(n):
    return [
        {
            "benchmark": "aime",
            "id": f"t{i}",
            "problem": f"Compute {i} + {i + 1}.",
            "answer": f"{2 * i + 1:03d}",
        }
        for i in range(n)
    ]


def _lines(path):
    return [
        json.loads(line)
        for line in path.read_text().splitlines()
        if line.startswith("{") and line.endswith("}")
    ]


def test_output_lines_and_scoring(tmp_path):
    out = tmp_path / "gen.jsonl"
    summary = run_generation(_aime_tasks(3), SumGenerator(), out, samples=4, seed=5, progress=False)
    assert summary.written == 12
    lines = _lines(out)
    assert {(r["id"], r["sample"]) for r in lines} == {(f"t{i}", s) for i in range(3) for s in range(4)}
    first = lines[0]
    assert set(first) >= {"benchmark", "id", "sample", "prompt", "response", "answer", "answer_type", "seed"}
    assert first["answer"] == "001" and "\\boxed{}" in first["prompt"]
    scored, _ = score_records(read_jsonl(out).records)
    assert [s["correct"] for s in scored] == [r["seed"] % 2 == 0 for r in lines]
    assert [r["seed"] for r in lines if r["id"] == "t1"] == [lines[4]["seed"] + i for i in range(4)]


def test_resume_after_crash_matches_uninterrupted_run(tmp_path):
    tasks = _aime_tasks(7)
    full = tmp_path / "full.jsonl"
    run_generation(tasks, SumGenerator(), full, samples=3, seed=1, batch_size=2, progress=False)

    out = tmp_path / "resumed.jsonl"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_generation(
            tasks, SumGenerator(fail_after_calls=2), out, samples=3, seed=1, batch_size=2, progress=False
        )
    assert len(_lines(out)) == 2 * 2 * 3  # two batches of two tasks were written before the crash
    with open(out, "a") as f:
        f.write('{"benchmark": "aime", "id": "t4", "sam')  # a kill in the middle of a line
    partial_line = len(out.read_text().splitlines())

    resumed = SumGenerator()
    summary = run_generation(tasks, resumed, out, samples=3, seed=1, batch_size=2, progress=False)
    assert summary.already_done == 12 and summary.written == 9 and resumed.requests == 3
    assert [p.line for p in summary.problems] == [partial_line]

    def key(r):
        return r["id"], r["sample"], r["response"], r["seed"], r["prompt"]

    assert sorted(map(key, _lines(out))) == sorted(map(key, _lines(full)))
    again = SumGenerator()
    assert (
        run_generation(tasks, again, out, samples=3, seed=1, progress=False).written == 0 and again.calls == 0
    )


class LongestOptionGenerator:
    """Picks the option with the longest text, answering in the GPQA answer-line format."""

    def generate(self, conversations, n, seeds):
        out = []
        for conv in conversations:
            options = dict(re.findall(r"^([A-D])\) (.*)$", conv[-1]["content"], re.M))
            out.append([f"Reasoning.\nAnswer: {max(options, key=lambda k: len(options[k]))}"] * n)
        return out


def test_gpqa_shuffle_is_per_sample_recorded_and_gold_letter_points_at_correct_option(tmp_path):
    task = {
        "benchmark": "gpqa",
        "id": "g1",
        "question": "Which is longest?",
        "correct": "a long correct option",
        "incorrect": ["no", "nope", "never"],
    }
    out = tmp_path / "gpqa.jsonl"
    run_generation([task], LongestOptionGenerator(), out, samples=8, seed=3, progress=False)
    lines = _lines(out)
    perms = [r["permutation"] for r in lines]
    assert perms == [gpqa_permutation(3, "g1", s) for s in range(8)]
    # the recorded shuffle seed alone reproduces the order
    assert all(random.Random(r["shuffle_seed"]).sample(range(4), 4) == r["permutation"] for r in lines)
    assert len({tuple(p) for p in perms}) > 1  # the order changes between samples
    for r in lines:
        shown = dict(re.findall(r"^([A-D])\) (.*)$", r["prompt"], re.M))
        assert shown[r["answer"]] == "a long correct option"
    scored, _ = score_records(read_jsonl(out).records)
    assert all(s["correct"] for s in scored)


def _hle_image_tasks(image: str) -> list[dict]:
    return [
        {
            "benchmark": "hle",
            "id": "h1",
            "question": "Compute 1 + 1.",
            "image": "",
            "answer": "2",
            "answer_type": "exactMatch",
            "category": "Math",
        },
        {
            "benchmark": "hle",
            "id": "h2",
            "question": "Compute 2 + 2.",
            "image": image,
            "answer": "4",
            "answer_type": "exactMatch",
            "category": "Math",
        },
    ]


class PartsGenerator(SumGenerator):
    """SumGenerator on the text of a message with content parts; keeps every conversation it was given."""

    def __init__(self):
        super().__init__()
        self.seen: list = []

    def generate(self, conversations, n, seeds):
        self.seen.extend(conversations)
        texts = [
            [{**m, "content": "".join(p.get("text", "") for p in m["content"])} for m in conv]
            if isinstance(conv[-1]["content"], list)
            else conv
            for conv in conversations
        ]
        return super().generate(texts, n, seeds)


def test_hle_image_tasks_are_sent_with_their_image(tmp_path):
    import base64
    import hashlib

    image = "data:image/png;base64," + base64.b64encode(b"\x89PNG any bytes").decode()
    tasks = _hle_image_tasks(image)
    gen, out = PartsGenerator(), tmp_path / "hle.jsonl"
    summary = run_generation(tasks, gen, out, samples=2, progress=False)
    assert (summary.image_tasks, summary.image_tasks_skipped, summary.written) == (1, 0, 4)
    by_task = {
        conv[0]["content"] if isinstance(conv[0]["content"], str) else "parts": conv for conv in gen.seen
    }
    parts = by_task["parts"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url"]  # the text, then the image (HLE's order)
    assert parts[1]["image_url"] == {"url": image} and "Compute 2 + 2." in parts[0]["text"]
    lines = _lines(out)
    digest = hashlib.sha256(b"\x89PNG any bytes").hexdigest()
    assert [r.get("image_sha256") for r in lines] == [None, None, digest, digest]
    assert all(r["response"] for r in lines) and all("image" not in r for r in lines)
    assert (
        run_generation(tasks, gen, out, samples=2, progress=False).already_done == 4
    )  # resumed: nothing new
    scored, _ = score_records(read_jsonl(out).records)
    assert len(scored) == 4 and not any(s.get("skipped") for s in scored)


def test_hle_image_that_cannot_be_sent_fails_its_samples_naming_the_task(tmp_path):
    tasks = _hle_image_tasks("data:image/png;base64,@@")
    gen, out = PartsGenerator(), tmp_path / "hle.jsonl"
    summary = run_generation(tasks, gen, out, samples=2, progress=False)
    assert (summary.written, summary.failed) == (4, 2) and gen.requests == 1  # h1 only
    assert summary.warnings == [
        "task 'h2': field 'image': the data: URL's base64 content does not decode (Only base64 data is "
        "allowed): its 2 sample(s) are written as failed"
    ]
    failed = [r for r in _lines(out) if r["id"] == "h2"]
    assert [r["sample"] for r in failed] == [0, 1] and all(r["response"] is None for r in failed)
    assert failed[0]["error"].startswith("task 'h2': field 'image':")


def test_hle_image_tasks_skipped_on_request_are_recorded_once(tmp_path):
    tasks = _hle_image_tasks("data:image/png;base64,AAAA")
    out = tmp_path / "hle.jsonl"
    for _ in range(2):  # the second run resumes and must not duplicate the skip record
        summary = run_generation(tasks, SumGenerator(), out, samples=2, progress=False, skip_image_tasks=True)
        assert summary.image_tasks_skipped == 1
    lines = _lines(out)
    assert [(r["id"], r["sample"]) for r in lines if r["id"] == "h2"] == [("h2", None)]
    assert lines[0]["skipped"].startswith("image")
    assert "Exact Answer:" in [r for r in lines if r["id"] == "h1"][0]["prompt"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="samples must be >= 1"):
        run_generation(_aime_tasks(1), SumGenerator(), "unused.jsonl", samples=0, progress=False)


def test_resume_fills_holes_with_the_seeds_an_uninterrupted_run_uses(tmp_path):
    tasks = _aime_tasks(4)
    full = tmp_path / "full.jsonl"
    run_generation(tasks, SumGenerator(), full, samples=5, seed=9, progress=False)
    holes = {("t0", 1), ("t2", 0), ("t2", 2), ("t2", 3), ("t3", 4)}
    out = tmp_path / "holes.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in _lines(full) if (r["id"], r["sample"]) not in holes))
    gen = SumGenerator()
    summary = run_generation(tasks, gen, out, samples=5, seed=9, progress=False)
    assert summary.written == 5 and gen.requests == 4  # t2's holes 0 and 2-3 are two requests

    def key(r):
        return r["id"], r["sample"], r["response"], r["seed"]

    assert sorted(map(key, _lines(out))) == sorted(map(key, _lines(full)))


class FailingGenerator:
    """Every request fails the way the engine reports a bad request: no text, an error."""

    def generate(self, conversations, n, seeds):
        return [[Completion(None, "error", "prompt too long")] * n for _ in conversations]


def test_failed_requests_are_written_and_score_as_wrong(tmp_path):
    out = tmp_path / "gen.jsonl"
    summary = run_generation(_aime_tasks(2), FailingGenerator(), out, samples=2, progress=False)
    assert summary.written == 4 and summary.failed == 4
    lines = _lines(out)
    assert all(r["response"] is None and r["error"] == "prompt too long" for r in lines)
    scored, _ = score_records(read_jsonl(out).records)
    assert [s["correct"] for s in scored] == [False] * 4


def test_resume_warns_when_its_parameters_changed(tmp_path):
    from deepinfer_eval import SamplingConfig

    tasks, out = _aime_tasks(3), tmp_path / "gen.jsonl"
    sampling = SamplingConfig(temperature=0.6, top_p=0.95, max_tokens=100)
    run_generation(tasks, SumGenerator(), out, samples=2, seed=1, sampling=sampling, progress=False)
    same = run_generation(tasks, SumGenerator(), out, samples=3, seed=1, sampling=sampling, progress=False)
    assert same.written == 3 and same.warnings == []

    other = SamplingConfig(temperature=1.0, top_p=0.95, max_tokens=100)
    summary = run_generation(tasks, SumGenerator(), out, samples=4, seed=2, sampling=other, progress=False)
    assert summary.written == 3 and len(summary.warnings) == 2
    seed_warning, temp_warning = sorted(summary.warnings)
    assert "9 existing sample(s) were generated with seed (from --seed)" in seed_warning
    assert "temperature 0.6, this run uses 1.0" in temp_warning
