"""Repository-wide pytest options."""

import os

# Tests decode without drafts unless they ask for them (num_speculative_tokens / their own env), so
# step counts and timings do not depend on the reference's default of 5 drafts per step; the default
# itself is tested with the variable removed (packages/deepinfer/tests/test_engine_nextn_default.py).
os.environ.setdefault("DEEPINFER_USE_NEXTN_DECODE", "0")


def pytest_addoption(parser):
    parser.addoption(
        "--refresh-ppl-baseline",
        action="store_true",
        default=False,
        help="rewrite this platform's entries of tests/models/offline_decode_ppl.json (under its file lock) "
        "instead of comparing against them",
    )
    parser.addoption(
        "--failure-log",
        default=None,
        metavar="PATH",
        help="append each failing test's report to PATH as soon as it fails, so a run cut off by a time limit "
        "(the GPU machine's calls) still shows why (pytest prints tracebacks only in its closing summary)",
    )


def pytest_runtest_logreport(report):
    # under xdist every worker's reports reach the controller too: only the controller writes (set below)
    path = _failure_log_path
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


_failure_log_path = None


def pytest_configure(config):
    global _failure_log_path
    is_xdist_worker = hasattr(config, "workerinput")
    _failure_log_path = None if is_xdist_worker else config.getoption("--failure-log")
