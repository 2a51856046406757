"""Lazy access to NVML through nvidia-ml-py (the optional extra `nvml`).

NVML reads the driver without creating a CUDA context, so it is safe in the launcher. Every
caller treats None as "not available" and falls back to nvidia-smi or sysfs.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

log = logging.getLogger(__name__)


@contextmanager
def nvml_session():
    """Yield the pynvml module with NVML initialised, or None when it cannot be used here."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        log.debug("NVML unavailable: %s", exc)
        yield None
        return
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # shutting down a half-initialised library must not mask the result
            pass


def as_str(value) -> str:
    """NVML returns bytes in old bindings and str in new ones."""
    return value.decode() if isinstance(value, bytes) else str(value)
