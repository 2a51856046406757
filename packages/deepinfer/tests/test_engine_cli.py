"""The `deepinfer` CLI: --help everywhere, and generate on a prompts file writes valid JSONL."""

import json
import subprocess
import sys

import pytest
from deepinfer.cli import main


@pytest.mark.parametrize(
    "argv", [["--help"], ["generate", "--help"], ["bench", "--help"], ["launch", "--help"]]
)
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_eval_runs_the_deepinfer_eval_command_without_importing_it():
    """`deepinfer eval` hands its arguments to `deepinfer-eval` and returns its exit status; the engine's
    process never imports deepinfer_eval (which depends on the engine)."""
    pytest.importorskip("deepinfer_eval", reason="deepinfer eval needs the deepinfer-eval package")
    code = (
        "import sys\n"
        "from deepinfer.cli import main\n"
        "status = main(sys.argv[1:])\n"
        "print('imported deepinfer_eval:', 'deepinfer_eval' in sys.modules)\n"
        "sys.exit(status)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, "eval", "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "usage: deepinfer-eval" in run.stdout and "convert" in run.stdout
    assert "imported deepinfer_eval: False" in run.stdout
    bad = subprocess.run(
        [sys.executable, "-c", code, "eval", "no-such-stage"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2  # argparse's usage error, passed through
    assert "usage: deepinfer-eval" in bad.stderr and "invalid choice" in bad.stderr


def test_generate_jsonl_round_trip(real_vocab_checkpoint, tmp_path, capsys):
    src = tmp_path / "prompts.jsonl"
    lines = [
        {"id": "a", "prompt": "The capital of France is a city called"},
        {"id": "b", "prompt_token_ids": [0, 5, 6, 7, 8, 9, 10, 11, 12], "sampling_params": {"max_tokens": 2}},
        {"id": "c", "messages": [{"role": "user", "content": "Tell me something about the sea"}]},
        {"id": "bad", "prompt": "A perfectly fine prompt of a good length", "sampling_params": {"top_k": 0}},
    ]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    dst = tmp_path / "out.jsonl"
    code = main(
        [
            "generate",
            "--input",
            str(src),
            "--output",
            str(dst),
            "--model",
            str(real_vocab_checkpoint),
            "--max-tokens",
            "3",
            "--no-progress",
            "--block-size",
            "16",
            "--max-model-len",
            "128",
        ]
    )
    assert code == 1  # one request failed
    # one line per request, in the order they finished (the refused one first: it never ran)
    lines = [json.loads(x) for x in dst.read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == ["a", "b", "bad", "c"]
    records = {r["id"]: r for r in lines}
    assert [records[i]["index"] for i in "abc"] == [0, 1, 2]
    assert [len(records[i]["outputs"][0]["token_ids"]) for i in "abc"] == [3, 2, 3]
    assert all(
        records[i]["error"] is None and isinstance(records[i]["outputs"][0]["text"], str) for i in "abc"
    )
    bad = records["bad"]
    assert bad["error"] and "top_k" in bad["error"] and bad["outputs"] == []
    assert records["a"]["metrics"]["ttft_s"] >= 0
    assert "output tokens/s" in capsys.readouterr().err


def test_ctrl_c_during_generate_exits_cleanly(micro_checkpoint, tmp_path):
    """A real SIGINT while the model runs: exit status 130, a one-line message, no traceback."""
    import os
    import signal
    import time

    src = tmp_path / "many.jsonl"
    # 64 x 200 tokens: ~5-12 s of generation, well past the signal
    src.write_text(
        "".join(json.dumps({"prompt_token_ids": [0, 5, 6, 7, 8, 9 + i]}) + "\n" for i in range(64))
    )
    cmd = [
        sys.executable,
        "-m",
        "deepinfer.cli",
        "generate",
        "--input",
        str(src),
        "--model",
        str(micro_checkpoint),
        "--max-tokens",
        "200",
        "--ignore-eos",
        "--block-size",
        "16",
        "--max-model-len",
        "256",
        "--num-threads",
        "1",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # a shell's background job inherits SIGINT ignored, and Python then installs no handler for it: the
    # CLI must be tested as a terminal runs it (default disposition)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 60
    seen = ""
    while "loaded" not in seen and time.time() < deadline:  # the model is loaded: generation starts
        seen += proc.stderr.readline()
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err


def test_eval_without_the_eval_package_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "deepinfer_eval", None)  # as if it were not installed
    assert main(["eval", "--help"]) == 2
    assert "needs the deepinfer-eval package" in capsys.readouterr().err
