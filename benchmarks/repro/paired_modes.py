"""What the batch-invariant benchmarks share: the two modes, the order in which paired runs alternate them,
and setting the mode's environment variable for a run (restored afterwards)."""

from __future__ import annotations

import os

from deepinfer.bench.engine_driver import environment
from deepinfer_model.batch_invariant import ENV  # the variable the mode reads

MODES = {"default": "0", "batch_invariant": "1"}


def paired_work(batch_sizes, repeats: int) -> list[tuple[int, int, str]]:
    """(batch, repeat, mode) in run order: both modes back to back per repeat, the first mode alternating
    repeat by repeat, so machine load drifting during a run hits both alike."""
    order = list(MODES)
    return [(b, r, m) for b in batch_sizes for r in range(repeats) for m in order[:: 1 - 2 * (r % 2)]]


def restored_mode():
    """Within the block `set_mode` may switch the mode freely; the variable's value before is restored."""
    return environment(ENV, os.environ.get(ENV))


def set_mode(mode: str) -> None:
    os.environ[ENV] = MODES[mode]


def add_workload_args(ap) -> None:
    """The workload options both scripts take (deepinfer-tiny on the paged runner)."""
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
