"""Repository-wide pytest options."""


def pytest_addoption(parser):
    parser.addoption(
        "--refresh-ppl-baseline",
        action="store_true",
        default=False,
        help="rewrite this platform's entries of tests/models/offline_decode_ppl.json (under its file lock) "
        "instead of comparing against them",
    )
