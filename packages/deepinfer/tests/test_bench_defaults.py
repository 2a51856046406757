"""`deepinfer bench` through a subprocess on the default model: decode with the default lengths fits the
model's context, a request that cannot fit stops before any engine is built, and a sweep whose decode
phase fails keeps the prefill rows it measured."""

import json
import subprocess
import sys


def run_cli(*argv, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", *argv], capture_output=True, text=True, timeout=timeout
    )


def test_decode_with_the_default_lengths_runs_on_the_default_model(tmp_path):
    # default context, warm-up, measured and profile steps, and DEEPINFER_USE_NEXTN_DECODE's default of 5
    # drafts: 501 positions per request asked of a 256-position model
    run = run_cli(
        "bench", "decode", "--nextn", "5", "--batches", "1", "--num-threads", "1", "--no-progress",
        "--no-plot", "--results-dir", str(tmp_path), "--name", "d",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr + run.stdout
    assert "the model allows 256 positions" in run.stdout
    (row,) = json.loads((tmp_path / "d.json").read_text())
    assert row["phase"] == "decode" and row["batch"] == 1 and row["intervals"] == 8


def test_decode_that_cannot_fit_stops_before_loading(tmp_path):
    run = run_cli("bench", "decode", "--decode-context", "250", "--results-dir", str(tmp_path))
    assert run.returncode == 1
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("deepinfer bench decode: error: decode needs 250 prompt")
    assert "the model allows 256: lower --decode-context" in line
    assert "ceilings" not in run.stdout and not list(tmp_path.iterdir())  # no engine ran, nothing written


def test_sweep_keeps_the_prefill_rows_when_decode_fails(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run = run_cli(
        "bench", "sweep", "--chunks", "16", "--prefill-repeats", "1", "--batches", "1", "--decode-context", "8",
        "--warmup-steps", "0", "--measure-steps", "1", "--nextn", "0", "--num-threads", "1", "--no-progress",
        "--no-plot", "--results-dir", str(tmp_path), "--name", "s",
        "--profile-decode-batch", "1", "--profile-dir", str(blocker / "profiles"),  # decode's profile fails
    )  # fmt: skip
    assert run.returncode == 1
    assert "Traceback" not in run.stderr and run.stderr.startswith("deepinfer bench sweep: error:")
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [(r["phase"], r["chunk_tokens"]) for r in rows] == [("prefill", 16)]
