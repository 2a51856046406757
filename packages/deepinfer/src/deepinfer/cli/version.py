"""`deepinfer --version`: the versions of the engine's packages, read from their installed metadata
(nothing is imported)."""

from __future__ import annotations

import argparse
import platform
import sys

PACKAGES = (
    "deepinfer",
    "deepinfer-model",
    "deepinfer-sched",
    "deepinfer-structured",
    "deepinfer-spec",
    "deepinfer-parallel",
    "deepinfer-cluster",
    "deepinfer-eval",
    "torch",
    "xgrammar",
    "tokenizers",
)


def version_lines() -> list[str]:
    from importlib import metadata

    lines = []
    for name in PACKAGES:
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            if name == "deepinfer-eval":  # an optional companion: say it is absent
                lines.append(f"{name} (not installed)")
    lines.append(f"python {platform.python_version()}")
    return lines


class VersionAction(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(
            option_strings,
            dest=dest,
            default=default,
            nargs=0,
            help=help or "print the versions of deepinfer and the packages it runs on, then exit",
        )

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write("\n".join(version_lines()) + "\n")
        parser.exit()
