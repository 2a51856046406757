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
    parser.addoption(
        "--timing-log",
        default=None,
        metavar="PATH",
        help="append each test phase (setup, call, teardown) of at least 1 s to PATH as it ends: "
        "'seconds phase outcome nodeid', the slow tests of a run cut off before --durations prints them",
    )
    parser.addoption(
        "--slow-first",
        action="store_true",
        default=False,
        help="run the tests marked slow before the others (each group in collection order), so under "
        "xdist the longest tests start at once instead of last, when a time limit may cut them off",
    )


def pytest_runtest_logreport(report):
    # under xdist every worker's reports reach the controller too: only the controller writes (set below)
    if _logs["failures"] and report.failed:
        with open(_logs["failures"], "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
    if _logs["timings"] and report.duration >= 1.0:
        with open(_logs["timings"], "a") as f:
            f.write(f"{report.duration:8.1f} {report.when:8s} {report.outcome:7s} {report.nodeid}\n")


_logs = {"failures": None, "timings": None}


def pytest_configure(config):
    is_xdist_worker = hasattr(config, "workerinput")
    for key, option in (("failures", "--failure-log"), ("timings", "--timing-log")):
        _logs[key] = None if is_xdist_worker else config.getoption(option)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow-first"):  # (every xdist worker sorts its collection the same way)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
