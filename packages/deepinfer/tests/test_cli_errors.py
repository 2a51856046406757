"""The `deepinfer` command through a subprocess: help, version, usage errors and the sampling flag checks
without torch; mistakes in flags, paths and the model reported in one line with exit status 2 before anything
loads; tracebacks only with --debug / DEEPINFER_DEBUG=1. (How fast these answer is measured by
benchmarks/engine/cli_startup.py, not here.)"""

import json
import os
import subprocess
import sys

import pytest
import torch

HEAVY = ("torch", "deepinfer_model", "torch._dynamo")
PROBE = (
    "import json, sys\n"
    "from deepinfer.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "except SystemExit as e:\n"
    "    code = e.code\n"
    f"print(json.dumps({{'code': code, 'loaded': [m for m in {HEAVY!r} if m in sys.modules]}}))\n"
)


def run_cli(*argv, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "argv, code",
    [
        (["--help"], 0),
        (["generate", "--help"], 0),
        (["bench", "--help"], 0),
        (["bench", "decode", "--help"], 0),
        (["--version"], 0),
        ([], 2),
        (["generate"], 2),
        (["generate", "--prompt", "x", "--max-tokens", "many"], 2),
        (["generate", "--input", "/nonexistent/in.jsonl"], 2),
        (["generate", "--prompt", "x", "--model", "/nonexistent/model"], 2),
        (["generate", "--prompt", "x", "--output", "/nonexistent/dir/out.jsonl"], 2),
    ],
)
def test_help_version_and_early_errors_import_neither_torch_nor_the_model(argv, code):
    run = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=300)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"code": code, "loaded": []}, run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    "flag, value, field",
    [
        ("--top-p", "0", "top_p"),
        ("--temperature", "-1", "temperature"),
        ("--max-tokens", "-1", "max_tokens"),
        ("--n", "0", "n"),
    ],
)
def test_bad_sampling_flags_import_no_torch(flag, value, field):
    """The flag checks build a SamplingParams: its rules are plain Python, so the check answers at once
    (the model package's `__init__` is loaded, none of its torch code)."""
    argv = ["generate", "--prompt", "x", flag, value]
    run = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=300)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"code": 2, "loaded": ["deepinfer_model"]}, run.stderr
    assert run.stderr.splitlines() == [run.stderr.strip()]  # one line
    assert run.stderr.startswith(f"deepinfer generate: error: {flag}:") and field in run.stderr


def test_sampling_params_import_no_torch():
    code = (
        "import sys\n"
        "import deepinfer.sampling_params\n"
        "from deepinfer import SamplingParams\n"
        "SamplingParams(temperature=0.5, top_p=0.9, max_tokens=4, seed=3)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_version_names_the_packages():
    run = run_cli("--version")
    assert run.returncode == 0
    lines = run.stdout.splitlines()
    assert lines[0] == "deepinfer 0.1.0"
    names = {line.split()[0] for line in lines}
    assert {"deepinfer-model", "deepinfer-sched", "deepinfer-structured", "torch", "python"} <= names


def test_help_documents_every_sampling_flag_with_its_default_once():
    run = run_cli("generate", "--help")
    assert run.returncode == 0
    lines = help_entries(run.stdout)
    for flag, default in [
        ("--max-tokens", "16"),
        ("--temperature", "0.0"),
        ("--top-p", "1.0"),
        ("--top-k", "-1"),
        ("--min-p", "0.0"),
        ("--n", "1"),
        ("--presence-penalty", "0.0"),
        ("--frequency-penalty", "0.0"),
        ("--repetition-penalty", "1.0"),
    ]:
        line = lines[flag]
        assert line.count("default:") == 1 and f"(default: {default})" in line, line
        assert len(line.split(flag, 1)[1].split("(default:")[0].split()) > 3, f"{flag} is not described"
    assert "API's SamplingParams defaults to 1.0" in lines["--temperature"]
    assert all(line.count("default:") <= 1 for line in lines.values())
    assert "skipped" in lines["--output"] and "resume" in lines["--output"].lower()
    for flag in ("--json-schema", "--regex", "--grammar", "--logprobs", "--debug"):
        assert flag in lines


def help_entries(text: str) -> dict[str, str]:
    """{flag: its whole help entry on one line} from argparse's output (entries wrap over lines)."""
    entries, current = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line.strip()
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize(
    "flag, value, field",
    [
        ("--max-tokens", "-1", "max_tokens"),
        ("--temperature", "-1", "temperature"),
        ("--top-p", "0", "top_p"),
        ("--n", "0", "n"),
        ("--presence-penalty", "2.5", "presence_penalty must be in [-2, 2]"),
        ("--frequency-penalty", "-3", "frequency_penalty must be in [-2, 2]"),
        ("--repetition-penalty", "0", "repetition_penalty must be in [0.01, 100]"),
        ("--regex", "(", "schema"),
        ("--json-schema", "not-a-file", "neither a file nor JSON"),
    ],
)
def test_bad_sampling_flags_stop_before_the_model_loads(flag, value, field):
    run = run_cli("generate", "--prompt", "x", flag, value)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [run.stderr.strip()]  # one line
    assert run.stderr.startswith(f"deepinfer generate: error: {flag}:") and field in run.stderr
    assert "loading model" not in run.stderr and "Traceback" not in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line():
    run = run_cli("generate", "--prompt", "x", "--device", "cuda")
    assert run.returncode == 2
    assert run.stderr.strip().startswith("deepinfer generate: error: --device:")
    assert "CUDA is not available" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_missing_model_input_and_output_name_what_is_wrong(tmp_path):
    cases = [
        (["--prompt", "x", "--model", str(tmp_path / "nope")], "--model:", "config.json"),
        (["--input", str(tmp_path / "in.jsonl")], "--input", "no such file"),
        (["--prompt", "x", "--output", str(tmp_path / "d" / "o.jsonl")], "--output", "does not exist"),
        (["--prompt", "x", "--output", str(tmp_path)], "--output", "is a directory"),
    ]
    for argv, flag, words in cases:
        run = run_cli("generate", *argv)
        assert run.returncode == 2, run.stderr
        (line,) = run.stderr.strip().splitlines()
        assert line.startswith(f"deepinfer generate: error: {flag}") and words in line


def test_debug_shows_the_traceback(tmp_path):
    argv = ["generate", "--prompt", "x", "--model", str(tmp_path / "nope")]
    for run in (run_cli(*argv, "--debug"), run_cli(*argv, env={"DEEPINFER_DEBUG": "1"})):
        assert run.returncode != 0
        assert "Traceback" in run.stderr and "config.json" in run.stderr
