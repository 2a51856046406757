"""`deepinfer run-batch`: one result per input line, in input order, equal to the offline engine; bad lines
get the server's 4xx body; a stopped run resumes without redoing what is done; a bad file fails up front."""

import json

import pytest
from deepinfer import LLM, SamplingParams
from deepinfer.batch import main

MESSAGES = [{"role": "user", "content": "Say something"}]


def _lines():
    return [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions",
         "body": {"model": "micro", "prompt": "Hello there", "max_tokens": 6, "seed": 11}},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "micro", "messages": MESSAGES, "max_tokens": 5, "seed": 12, "temperature": 0.7}},
        {"custom_id": "c", "method": "POST", "url": "/v1/completions",
         "body": {"model": "micro", "prompt": "x", "temperature": -1}},
        {"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {"model": "other", "prompt": "x"}},
        {"custom_id": "e", "method": "POST", "url": "/v1/completions",
         "body": {"model": "micro", "prompt": "Once upon", "max_tokens": 4, "seed": 13, "n": 2}},
    ]  # fmt: skip


def _run(checkpoint, inp, out):
    return main(
        ["-i", str(inp), "-o", str(out), "--no-progress", "--model", str(checkpoint),
         "--served-model-name", "micro", "--max-model-len", "256", "--block-size", "16"]
    )  # fmt: skip


def test_results_equal_offline_bad_lines_get_errors_and_runs_resume(real_vocab_checkpoint, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in _lines()))
    assert _run(real_vocab_checkpoint, inp, out) == 1  # two lines are refused
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["a", "b", "c", "d", "e"]
    status = {r["custom_id"]: r["response"]["status_code"] for r in records}
    assert status == {"a": 200, "b": 200, "c": 400, "d": 404, "e": 200}
    by_id = {r["custom_id"]: r["response"]["body"] for r in records}
    assert by_id["c"]["error"]["param"] == "temperature"
    assert by_id["d"]["error"]["code"] == "model_not_found"

    with LLM(model=str(real_vocab_checkpoint), max_model_len=256, block_size=16) as llm:
        a = llm.generate("Hello there", SamplingParams(max_tokens=6, seq_seed=11), use_tqdm=False)[0]
        b = llm.chat(MESSAGES, SamplingParams(max_tokens=5, seq_seed=12, temperature=0.7), use_tqdm=False)[0]
        e = llm.generate("Once upon", SamplingParams(max_tokens=4, seq_seed=13, n=2), use_tqdm=False)[0]
    assert by_id["a"]["choices"][0]["text"] == a.outputs[0].text
    assert by_id["a"]["usage"]["completion_tokens"] == len(a.outputs[0].token_ids)
    assert by_id["b"]["choices"][0]["message"]["content"] == b.outputs[0].text
    assert [c["text"] for c in by_id["e"]["choices"]] == [c.text for c in e.outputs]

    # a run stopped after three results, the fourth torn mid-line: resume redoes only d and e
    kept = out.read_text().splitlines()[:3]
    out.write_text("".join(line + "\n" for line in kept) + kept[0][:20])
    assert _run(real_vocab_checkpoint, inp, out) == 1
    again = out.read_text().splitlines()
    assert again[:3] == kept  # same ids: not run again
    records2 = [json.loads(line) for line in again]
    assert [r["custom_id"] for r in records2] == ["a", "b", "c", "d", "e"]
    assert records2[4]["id"] != records[4]["id"]
    assert records2[4]["response"]["body"]["choices"] == records[4]["response"]["body"]["choices"]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"custom_id": "a", "url": "/v1/completions", "body": {}}\n' * 2, "custom_id 'a' appears twice"),
        ('{"custom_id": "a", "url": "/v1/embeddings", "body": {}}\n', "url must be one of"),
        (
            '{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}\n',
            "method must be POST",
        ),
        ("not json\n", "invalid JSON"),
        ('{"url": "/v1/completions", "body": {}}\n', "custom_id must be a non-empty string"),
    ],
)
def test_bad_batch_file_fails_before_loading_naming_the_line(tmp_path, capsys, line, message):
    inp = tmp_path / "in.jsonl"
    inp.write_text(line)
    assert main(["-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert message in err and f"{inp}:" in err
    assert not (tmp_path / "out.jsonl").exists()
