"""The LLM judge against a small OpenAI-compatible server on 127.0.0.1, and its on-disk cache."""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from deepinfer_eval import Completion, GeneratorBackend, HttpChatBackend, JudgeCache, JudgeItem, LLMJudge
from deepinfer_eval.cli import main


def _grade(prompt: str) -> str:
    """A tiny judge model: compares the response's answer line with the reference answer."""
    response = prompt.split("[response]\n", 1)[1].split("\n\n[reference answer]", 1)[0]
    reference = prompt.split("[reference answer]\n", 1)[1].split("\n\n", 1)[0]
    m = re.findall(r"Answer:\s*(.+)", response)
    extracted = m[-1].strip() if m else "None"
    conf = re.findall(r"Confidence:\s*(\d+)", response)
    ok = extracted.casefold() == reference.casefold()
    return (
        f"extracted_final_answer: {extracted}\nreasoning: compared.\ncorrect: {'yes' if ok else 'no'}\n"
        f"confidence: {conf[-1] if conf else 100}"
    )


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions":
            self.server.not_found += 1
            self.send_error(404, "no such route")
            return
        self.server.requests.append(body)
        prompt = body["messages"][-1]["content"]
        if "FAIL_ONCE" in prompt and not self.server.failed_once:
            self.server.failed_once = True
            self.send_error(500, "overloaded")
            return
        content = "I refuse." if "GIBBERISH" in prompt else _grade(prompt)
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.requests, server.failed_once, server.not_found = [], False, 0
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    guard = threading.Timer(60, server.shutdown)  # never outlives a hung test
    thread.start()
    guard.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        guard.cancel()
        server.shutdown()
        server.server_close()
        thread.join(5)


def _items():
    return [
        JudgeItem(
            "Capital of France?",
            "<think>hmm</think>Explanation: known.\nExact Answer: Paris\nConfidence: 90%",
            "Paris",
            "exactMatch",
        ),
        JudgeItem("2+2?", "Exact Answer: 5\nConfidence: 60%", "4", "exactMatch"),
        JudgeItem("q", "Exact Answer: x FAIL_ONCE", "x FAIL_ONCE", "exactMatch"),
        JudgeItem("q", "Exact Answer: GIBBERISH", "y", "exactMatch"),
        JudgeItem("q", None, "y", "exactMatch"),  # missing response: wrong without asking
        JudgeItem("q", "<think>never finished", "y", "exactMatch"),
    ]


def test_llm_judge_verdicts_errors_and_cache(tmp_path, judge_server):
    server, url = judge_server
    cache_path = tmp_path / "cache.jsonl"
    backend = HttpChatBackend(url, "judge-model", api_key="k", workers=3, retries=0)
    judge = LLMJudge(backend, JudgeCache(cache_path))
    v = judge.judge(_items())
    assert [x.correct for x in v] == [True, False, False, False, False, False]
    assert (v[0].extracted, v[0].confidence, v[1].confidence) == ("Paris", 0.9, 0.6)
    assert "500" in v[2].error and "yes/no" in v[3].error and v[4].error is None and v[5].error is None
    assert judge.calls == 4 and len(server.requests) == 4
    assert server.requests[0]["model"] == "judge-model" and server.requests[0]["temperature"] == 0.0
    # the judge sees the final part only, never the reasoning
    assert all("<think>" not in r["messages"][0]["content"] for r in server.requests)

    # rescore with a fresh judge on the same cache: only the two failures are asked again
    again = LLMJudge(HttpChatBackend(url, "judge-model", workers=2), JudgeCache(cache_path))
    v2 = again.judge(_items())
    assert again.calls == 2 and v2[2].correct is True and v2[0] == v[0] and v2[1] == v[1]
    # a different judge model does not reuse those answers
    other = LLMJudge(HttpChatBackend(url, "other-model"), JudgeCache(cache_path))
    other.judge(_items()[:1])
    assert other.calls == 1


def test_score_cli_with_openai_judge_rescore_is_free(tmp_path, judge_server, capsys):
    server, url = judge_server
    gen = tmp_path / "gen.jsonl"
    recs = [
        {
            "benchmark": "hle",
            "id": f"h{i}",
            "sample": 0,
            "question": "q",
            "answer": str(i),
            "answer_type": "exactMatch",
            "category": "Math" if i % 2 else "Physics",
            "response": f"Exact Answer: {i if i < 3 else 0}\nConfidence: 70%",
        }
        for i in range(5)
    ]
    gen.write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = [
        "score",
        "--generations",
        str(gen),
        "--output",
        str(tmp_path / "s.jsonl"),
        "--judge",
        "openai",
        "--judge-url",
        url,
        "--judge-model",
        "m",
    ]
    assert main(args) == 0
    first = (tmp_path / "s.jsonl").read_text()
    assert "5 judge call(s)" in capsys.readouterr().err
    assert main(args) == 0
    assert "0 judge call(s)" in capsys.readouterr().err
    assert (tmp_path / "s.jsonl").read_text() == first and len(server.requests) == 5
    scored = [json.loads(line) for line in first.splitlines()]
    assert [s["correct"] for s in scored] == [True, True, True, False, False]
    assert all(s["confidence"] == 0.7 and s["judge"] == f"llm:openai:m@{url}" for s in scored)


class GradingGenerator:
    """A Generator that judges like the server above, thinking first as a reasoning model does."""

    def __init__(self):
        self.prompts = 0

    def generate(self, conversations, n, seeds):
        self.prompts += len(conversations)
        out = []
        for conv in conversations:
            prompt = conv[-1]["content"]
            if "FAIL_ONCE" in prompt:
                out.append([Completion(None, "error", "engine refused")])
            else:
                out.append([f"<think>correct: no</think>{_grade(prompt)}"])
        return out


def test_llm_judge_on_a_generator_backend(tmp_path):
    gen = GradingGenerator()
    judge = LLMJudge(GeneratorBackend(gen, "local-judge"), JudgeCache(tmp_path / "c.jsonl"))
    v = judge.judge(_items()[:3])
    assert [x.correct for x in v] == [True, False, False] and "engine refused" in v[2].error
    assert judge.name == "llm:generator:local-judge" and gen.prompts == 3
    LLMJudge(GeneratorBackend(gen, "local-judge"), JudgeCache(tmp_path / "c.jsonl")).judge(_items()[:2])
    assert gen.prompts == 3  # cached


class CrashingGradingGenerator(GradingGenerator):
    def generate(self, conversations, n, seeds):
        if self.prompts:
            raise KeyboardInterrupt  # the user stops a long scoring run
        return super().generate(conversations, n, seeds)


def test_interrupted_judging_keeps_the_replies_it_already_has(tmp_path):
    items = [JudgeItem("q", f"Exact Answer: {i}", str(i % 2), "exactMatch") for i in range(5)]
    crashing = LLMJudge(
        GeneratorBackend(CrashingGradingGenerator(), "j"), JudgeCache(tmp_path / "c.jsonl"), chunk=2
    )
    with pytest.raises(KeyboardInterrupt):
        crashing.judge(items)
    resumed = LLMJudge(GeneratorBackend(GradingGenerator(), "j"), JudgeCache(tmp_path / "c.jsonl"), chunk=2)
    verdicts = resumed.judge(items)
    assert resumed.calls == 3 and [v.correct for v in verdicts] == [True, True, False, False, False]


def test_http_judge_retries_server_errors_but_not_bad_requests(judge_server):
    server, url = judge_server
    backend = HttpChatBackend(url, "m", retries=1, backoff_s=0.01)
    (reply,) = backend.complete([LLMJudge.prompt(_items()[2])])
    assert "correct: yes" in reply and len(server.requests) == 2  # the 500 was retried once
    (missing,) = HttpChatBackend(url.replace("/v1", "/nowhere"), "m", retries=3, backoff_s=0.01).complete(
        ["x"]
    )
    assert "404" in str(missing) and server.not_found == 1  # a client error is not retried
