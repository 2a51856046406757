"""`deepinfer generate` through a subprocess: results appended as requests finish and a rerun resuming,
bad input lines refused alone with their line number and id, labelled completions with logprobs,
the structured-output flags, and Ctrl-C while loading."""

import json
import os
import signal
import subprocess
import sys
import time

ENGINE = ["--block-size", "16", "--max-model-len", "128", "--num-threads", "1", "--no-progress"]


def run_cli(*argv, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", *argv], capture_output=True, text=True, timeout=timeout
    )


def write_jsonl(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def records(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


GOOD = [
    {"id": "a", "prompt": "The capital of France is a city called"},
    {"id": "b", "prompt_token_ids": [0, 5, 6, 7, 8, 9, 10, 11, 12], "sampling_params": {"max_tokens": 2}},
    {"id": "c", "messages": [{"role": "user", "content": "Tell me something about the sea"}]},
]
BAD = [
    {"id": "greedy", "prompt": "Some fine prompt", "sampling_params": "greedy"},  # line 4
    {"id": "role", "messages": [{"role": "narrator", "content": "42"}]},  # line 5: a role no template has
    "{not json",  # line 6
    {"id": "a", "prompt": "the same id again"},  # line 7
    {"id": "field", "prompt": "x", "sampling_params": {"temprature": 0.5}},  # line 8
]


def test_bad_lines_are_refused_alone_and_a_rerun_resumes(real_vocab_checkpoint, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, GOOD + BAD)
    argv = ["generate", "--input", str(src), "--output", str(dst), "--model", str(real_vocab_checkpoint)]
    first = run_cli(*argv, "--max-tokens", "3", *ENGINE)
    assert first.returncode == 1, first.stderr  # some requests failed; the others ran
    assert "Traceback" not in first.stderr
    errors = [line for line in first.stderr.splitlines() if line.startswith("deepinfer generate: error:")]
    assert len(errors) == 5
    for who, line_no, words in [
        ("'greedy'", 4, "sampling_params must be an object"),
        ("'role'", 5, "role"),
        ("#5", 6, "invalid JSON"),
        ("'a'", 7, "duplicate id"),
        ("'field'", 8, "temprature"),
    ]:
        (line,) = [e for e in errors if f"in.jsonl:{line_no})" in e]
        assert f"request {who}" in line and words in line, line
    out = records(dst)
    ok = {r["id"]: r for r in out if r["error"] is None}
    assert sorted(ok) == ["a", "b", "c"]
    assert [len(ok[i]["outputs"][0]["token_ids"]) for i in "abc"] == [3, 2, 3]
    assert len(out) == 8  # one line per request, refused ones included (with their error)

    # a run stopped after "a" finished, its last line cut off mid-write: the rerun runs only b and c
    dst.write_text(json.dumps(ok["a"]) + "\n" + '{"id": "b", "outp')
    second = run_cli(*argv, "--max-tokens", "3", *ENGINE)
    assert second.returncode == 1
    assert "resuming: 1 of 8 requests already have a result" in second.stderr
    lines = dst.read_text().splitlines()
    assert lines[1] == '{"id": "b", "outp'  # kept as it was; the next record starts on a new line
    again = [json.loads(x) for x in lines[2:]]
    done = {r["id"]: r for r in again if r["error"] is None}
    assert sorted(done) == ["b", "c"]  # "a" was not run again
    for i in "bc":  # greedy: the same tokens as the first run
        assert done[i]["outputs"][0]["token_ids"] == ok[i]["outputs"][0]["token_ids"]

    # everything done: a third run runs nothing but the refused lines again
    before = len(dst.read_text().splitlines())
    third = run_cli(*argv, "--max-tokens", "3", *ENGINE)
    assert third.returncode == 1 and "resuming: 3 of 8" in third.stderr
    new = [json.loads(x) for x in dst.read_text().splitlines()[before:]]
    assert len(new) == 5 and all(r["error"] for r in new)


def test_stdout_labels_each_completion_and_shows_logprobs(real_vocab_checkpoint, tmp_path):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": "first", "prompt": "Hello there"}, {"prompt": "A second prompt"}, BAD[0]])
    run = run_cli(
        "generate", "--input", str(src), "--model", str(real_vocab_checkpoint), "--max-tokens", "4",
        "--logprobs", "2", *ENGINE,
    )  # fmt: skip
    assert run.returncode == 1
    assert "=== id 'first': 'Hello there'" in run.stdout
    assert "=== #1: 'A second prompt'" in run.stdout
    blocks = run.stdout.split("=== ")[1:]
    assert len(blocks) == 2
    for block in blocks:
        body = block.split("--- logprobs", 1)[1].splitlines()[1:]
        token_lines = [x for x in body if x.startswith("  ")]
        assert len(token_lines) == 4  # one per generated token
        assert all(x.count("top:") == 1 and len(x.split("top:")[1].split(",")) == 2 for x in token_lines)
    # the error goes to stderr, naming the user's id, not to stdout
    assert "greedy" not in run.stdout
    assert "deepinfer generate: error: request 'greedy' (" in run.stderr


def test_regex_and_json_schema_flags_constrain_the_output(real_vocab_checkpoint, tmp_path):
    argv = ["generate", "--prompt", "Answer:", "--prompt", "Again:", "--model", str(real_vocab_checkpoint)]
    run = run_cli(*argv, "--regex", "(yes|no)", "--max-tokens", "8", "--temperature", "1", *ENGINE)
    assert run.returncode == 0, run.stderr
    texts = [b.split("\n", 1)[1].strip() for b in run.stdout.split("=== ")[1:]]
    assert len(texts) == 2 and all(t in ("yes", "no") for t in texts), texts

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"enum": ["red", "green", "blue"]}))
    out = tmp_path / "out.jsonl"
    run = run_cli(*argv, "--json-schema", str(schema), "--max-tokens", "8", "--output", str(out), *ENGINE)
    assert run.returncode == 0, run.stderr
    assert [json.loads(r["outputs"][0]["text"]) in ("red", "green", "blue") for r in records(out)] == [
        True
    ] * 2


def test_ctrl_c_keeps_finished_results_and_ctrl_c_while_loading_exits_130(real_vocab_checkpoint, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    quick = [
        {"id": f"q{i}", "prompt_token_ids": [0, 5, 6 + i], "sampling_params": {"max_tokens": 1}}
        for i in range(3)
    ]
    slow = [{"id": f"s{i}", "prompt_token_ids": [0, 7, 8 + i]} for i in range(16)]
    write_jsonl(src, quick + slow)
    cmd = [sys.executable, "-m", "deepinfer.cli", "generate", "--input", str(src), "--output", str(dst)]
    cmd += ["--model", str(real_vocab_checkpoint), "--max-tokens", "100", "--ignore-eos", *ENGINE]

    def interrupted_after(marker: str, delay: float):
        # a shell's background job ignores SIGINT; a terminal's does not: run it as a terminal would
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        seen, deadline = "", time.time() + 300
        while marker not in seen and time.time() < deadline:
            seen += proc.stderr.readline()
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        return proc.returncode, seen + err

    code, err = interrupted_after("loading model", 0.0)
    assert code == 130, err
    assert "interrupted" in err and "Traceback" not in err

    code, err = interrupted_after(" loaded in ", 3.0)
    assert code == 130, err
    assert "run the same command again to resume" in err and "Traceback" not in err
    kept = records(dst)
    assert {"q0", "q1", "q2"} <= {r["id"] for r in kept}  # finished in the first steps, written at once
    assert all(r["error"] is None and r["outputs"][0]["token_ids"] for r in kept)
