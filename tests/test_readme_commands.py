"""The README's commands run as written: the main command (between the main-command markers) through the
`deepinfer` entry point, and the test commands' pytest arguments collect (without running the suite)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def bash_commands(text: str) -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [shlex.split(line, comments=True) for b in blocks for line in b.splitlines() if line.strip()]


def section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_main_command_runs(tmp_path):
    """As on a fresh machine: the default model is not there yet, so the command says it generates it."""
    block = README.split("<!-- main-command -->", 1)[1].split("<!-- /main-command -->", 1)[0]
    (cmd,) = bash_commands(block)
    assert cmd[:3] == ["uv", "run", "deepinfer"], cmd
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_HF_MODEL_DIR"}
    env["DEEPINFER_CACHE_DIR"] = str(tmp_path / "cache")
    run = subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", *cmd[3:]],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert "first use: generating the default model deepinfer-tiny" in run.stderr
    prompt = cmd[cmd.index("--prompt") + 1]
    assert run.stdout.startswith(f"=== #0: {prompt!r}\n")  # the completion, labelled with its prompt
    assert "output tokens/s" in run.stderr  # the summary table


def test_the_test_commands_collect():
    commands = bash_commands(section("Test"))
    assert len(commands) >= 2
    for cmd in commands:
        assert cmd[:2] == ["uv", "run"] and "pytest" in cmd, cmd
        uv_flags, pytest_args = cmd[2 : cmd.index("pytest")], cmd[cmd.index("pytest") + 1 :]
        assert uv_flags in (["--all-packages"], ["--package", uv_flags[-1]]), uv_flags
        options = [a for a in pytest_args if a.startswith("-") or not ROOT.joinpath(a).exists()]
        paths = [a for a in pytest_args if a not in options]
        # the whole suite is only collected from one file, so the check stays quick; a named path whole;
        # the options as written (xdist's too: `-n 0` last collects in this process)
        paths = paths or ["tests/test_workspace.py"]
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *options, *paths]
            + (["-n", "0"] if "-n" in options else []),
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert re.search(r"\d+ tests? collected", run.stdout), run.stdout[-500:]
