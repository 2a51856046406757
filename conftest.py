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
