"""NVLink multicast (NVLS) stays off in every rank this project starts: on the shared GPU hosts it runs
on, a program using it can take the host's GPUs out of service."""

from __future__ import annotations

import contextlib
import os

# Forced, not defaulted, in every rank `launch` starts.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@contextlib.contextmanager
def no_multicast_environment():
    """`NO_MULTICAST_ENV` in `os.environ` while child processes start (spawn and fork copy the parent's
    environment), the caller's own values restored after: for code that starts ranks with
    multiprocessing rather than through `launch`."""
    before = {k: os.environ.get(k) for k in NO_MULTICAST_ENV}
    os.environ.update(NO_MULTICAST_ENV)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
