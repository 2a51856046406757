"""The repository's pytest options (conftest.py), for runs a time limit may cut off (the GPU machine's
calls, benchmarks/gpu/run_engine_suite.sh's gputests step): `--failure-log PATH` and `--timing-log PATH`
append each failing test's report, and each test phase of a second or more, to PATH as it ends, not only
in pytest's closing summary, so a cut-off run still says why its failures failed and where its time went;
`--slow-first` starts the tests marked slow first."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TESTS = """
import time
import pytest

def test_passes():
    assert True

@pytest.mark.slow
def test_slow():
    time.sleep(1.1)

def test_fails():
    values = [1, 2]
    assert sum(values) == 4, "the sum is off"

def test_fails_in_setup(missing_fixture):
    pass
"""


def _run_sample(tmp_path, *options: str) -> subprocess.CompletedProcess:
    """pytest on TESTS in tmp_path with the repository's conftest.py loaded as a plugin."""
    (tmp_path / "test_sample.py").write_text(TESTS)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "--rootdir", str(tmp_path),
         *options, str(tmp_path / "test_sample.py")],
        cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
    )  # fmt: skip


def test_failures_are_logged_as_they_happen(tmp_path):
    log = tmp_path / "failures.txt"
    run = _run_sample(tmp_path, "--failure-log", str(log))
    assert run.returncode == 1, run.stdout + run.stderr
    text = log.read_text()
    assert text.count("==== ") == 2, text  # once per failure, each written once
    assert "test_sample.py::test_fails (call)" in text and "the sum is off" in text
    assert "test_sample.py::test_fails_in_setup (setup)" in text and "missing_fixture" in text
    assert "test_passes" not in text


def test_no_log_without_the_option(tmp_path):
    assert _run_sample(tmp_path).returncode == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["test_sample.py"]


def test_slow_phases_are_logged_as_they_end(tmp_path):
    log = tmp_path / "timings.txt"
    _run_sample(tmp_path, "--timing-log", str(log))
    (line,) = log.read_text().splitlines()  # only the slow test's call phase took a second
    seconds, phase, outcome, nodeid = line.split()
    assert float(seconds) >= 1.1 and (phase, outcome) == ("call", "passed")
    assert nodeid.endswith("test_sample.py::test_slow")


def test_slow_tests_run_first(tmp_path):
    def order(*options):  # the run order: the collection after every hook
        run = _run_sample(tmp_path, "--collect-only", *options)
        return [line.split("::")[1] for line in run.stdout.splitlines() if "::test_" in line]

    assert order() == ["test_passes", "test_slow", "test_fails", "test_fails_in_setup"]
    assert order("--slow-first") == ["test_slow", "test_passes", "test_fails", "test_fails_in_setup"]
