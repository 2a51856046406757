"""How the `deepinfer` command reports failure: one line on stderr and an exit status, no traceback.

Exit statuses: 2 for a mistake in what the user gave (flags, paths, the model), found before anything
is loaded; 1 for a failure while running (some requests failed, the model could not load); 130 for
Ctrl-C, as a shell reports SIGINT. `--debug` or `DEEPINFER_DEBUG=1` re-raises instead, traceback
included.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

USAGE = 2
FAILED = 1
INTERRUPTED = 130
DEBUG_HINT = "--debug or DEEPINFER_DEBUG=1 shows the traceback"


class CliError(Exception):
    """A problem the user can fix, said in one line; `code` is the exit status."""

    def __init__(self, message: str, code: int = USAGE) -> None:
        super().__init__(message)
        self.code = code


def debug_requested(argv: list[str]) -> bool:
    if "--debug" in argv:
        return True
    from .. import envs

    try:
        return bool(envs.DEEPINFER_DEBUG)
    except ValueError:  # a bad value of the variable itself is not worth hiding the real error for
        return False


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if isinstance(error, ValueError | CliError) else f"{type(error).__name__}: {text}"


def run_reporting(prog: str, command: Callable[[], int], debug: bool) -> int:
    """Run `command`; turn what it raises into one line on stderr and an exit status."""
    try:
        return command()
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except CliError as e:
        if debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.code
    except Exception as e:
        if debug:
            raise
        print(f"{prog}: error: {one_line(e)} ({DEBUG_HINT})", file=sys.stderr)
        return FAILED
