"""A package `__init__` whose public names are imported from their modules on first use.

    _MODULES = {".config": ("ConfigError", "load_config"), ...}
    __getattr__, __dir__, __all__ = lazy_exports(__name__, globals(), _MODULES)

`_MODULES` maps each module, spelled as an import statement spells it (relative to the package or
absolute), to the names taken from it; the workspace import-graph test reads that table as the imports
the package makes. Standard library only, so any package may use it without loading anything else.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], modules: dict[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """(`__getattr__`, `__dir__`, `__all__`) of `package`, whose globals are `namespace`."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(module, package)
        # all of the module's names at once: importing it may have bound the package attribute of its
        # own name to the module, where a public name of that spelling belongs
        for public in modules[module]:
            namespace[public] = getattr(loaded, public)
        return namespace[name]

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__, sorted(where)
