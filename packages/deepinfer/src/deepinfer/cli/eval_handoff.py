"""`deepinfer eval ARGS`: hands over to the `deepinfer-eval` command."""

from __future__ import annotations

import importlib.util
import subprocess
import sys


def run_deepinfer_eval(args: list[str]) -> int:
    """`deepinfer eval ARGS` runs `deepinfer-eval ARGS` in a child of this interpreter and returns its exit
    status. deepinfer-eval depends on the engine (its `generate` extra), so the engine hands over to
    its command instead of importing it: the two packages form no import cycle."""
    if importlib.util.find_spec("deepinfer_eval") is None:
        print(
            "deepinfer eval needs the deepinfer-eval package: pip install 'deepinfer-eval[generate]'",
            file=sys.stderr,
        )
        return 2
    child = subprocess.Popen([sys.executable, "-m", "deepinfer_eval", *args])
    while True:
        try:
            code = child.wait()
        except KeyboardInterrupt:
            continue  # the child got the same interrupt; it decides how to stop (a stage is resumable)
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it
