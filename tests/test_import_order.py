"""Every module of every package imports when it is the first one a program imports.

A cycle through a package's `__init__` (importing `a.b.c` runs `a.b` first) goes unseen while some
other module happens to be imported before: the suite imports half the workspace before most tests,
and `tests/test_import_graph.py` reads the graph without running it. Here one interpreter imports each
module in turn with every workspace module forgotten before it (torch and the other libraries stay
loaded, which keeps this fast; the C++ scheduler's extension cannot be loaded twice, so its package stays).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PACKAGES = [
    "deepinfer",
    "deepinfer_model",
    "deepinfer_spec",
    "deepinfer_parallel",
    "deepinfer_structured",
    "deepinfer_cluster",
    "deepinfer_eval",
    "deepinfer_tiny",
]
# modules that need what the CPU machine does not have (GPU kernel toolchains)
NEEDS_GPU_TOOLS = ("deepinfer_model.backends.nvidia.tilelang_",)

SCRIPT = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    packages, skip = sys.argv[1].split(","), tuple(sys.argv[2].split(","))
    names = []
    for p in packages:
        names.append(p)
        mod = importlib.import_module(p)
        names += [m.name for m in pkgutil.walk_packages(mod.__path__, p + ".")]
    names = [n for n in names if not n.endswith("__main__") and not n.startswith(skip)]
    failed = []
    for name in names:
        for loaded in [m for m in sys.modules if m.split(".")[0] in packages]:
            del sys.modules[loaded]
        try:
            importlib.import_module(name)
        except Exception as e:
            failed.append(f"{name}: {type(e).__name__}: {e}")
    print(len(names))
    print("\\n".join(failed))
    """
)


def test_each_module_imports_first():
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(PACKAGES), ",".join(NEEDS_GPU_TOOLS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    count, *failed = run.stdout.strip().split("\n")
    assert int(count) > 200  # the walk found the workspace's modules
    failed = [f for f in failed if f]
    assert not failed, "modules that fail to import when imported first:\n" + "\n".join(failed)
