"""Image preprocessing off the engine thread: a pool of worker processes, each job with a deadline.

Decoding and resizing are CPU-heavy and Pillow holds the GIL for parts of them, so they run in separate
processes (spawned: the parent may hold torch threads that a fork would copy mid-state). A job that has not
finished within `DEEPINFER_MULTI_MODAL_WORKER_TIMEOUT` seconds fails its image with an `ImageError` and the
pool is replaced, so one stuck decode costs its own request, not the process (the reference aborts the
process instead).

`prepare` may be called from several threads (an engine prepares a request's images on a thread of its own
while its step loop runs): calls take turns on one lock, because replacing the pool of a stuck job would
cut off another call's jobs. `close` from any thread ends a call still waiting within a tenth of a second.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

from deepinfer_cluster import envs

from .config import VisionConfig
from .preprocess import ImageError, PreparedImage, prepare_image


def _job(data: bytes, vcfg: VisionConfig, label: str) -> PreparedImage | ImageError:
    try:
        return prepare_image(data, vcfg, label)
    except ImageError as e:
        return e


class ImagePreprocessor:
    """`prepare(images)` -> one `PreparedImage` or `ImageError` per image, in order."""

    def __init__(self, vcfg: VisionConfig, workers: int = 2, timeout_s: float | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.vcfg = vcfg
        self.workers = workers
        self.timeout_s = float(
            envs.get("DEEPINFER_MULTI_MODAL_WORKER_TIMEOUT") if timeout_s is None else timeout_s
        )
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        self._pool = None
        self._lock = threading.RLock()
        self._closing = threading.Event()

    def _ensure_pool(self):
        if self._pool is None:
            self._pool = multiprocessing.get_context("spawn").Pool(self.workers)
        return self._pool

    def prepare(
        self, images: list[bytes], labels: list[str] | None = None
    ) -> list[PreparedImage | ImageError]:
        labels = labels or [f"image {i}" for i in range(len(images))]
        with self._lock:
            timeout_s = self.timeout_s
            pool = self._ensure_pool()
            jobs = [
                pool.apply_async(_job, (data, self.vcfg, label))
                for data, label in zip(images, labels, strict=True)
            ]
            deadline = time.monotonic() + timeout_s
            out: list[PreparedImage | ImageError] = []
            stuck = False
            for job, label in zip(jobs, labels, strict=True):
                while not job.ready() and not self._closing.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    job.wait(min(left, 0.1))
                if job.ready():
                    out.append(job.get())
                    continue
                stuck = True
                if self._closing.is_set():
                    out.append(ImageError(f"{label}: the image preprocessor was closed"))
                else:
                    out.append(ImageError(f"{label}: preprocessing did not finish within {timeout_s:g} s"))
            if stuck:
                self._terminate()  # the stuck worker goes with its pool; the next call starts a fresh one
            return out

    def close(self) -> None:
        self._closing.set()  # a call waiting on another thread gives up, then releases the lock
        with self._lock:
            self._terminate()
            self._closing.clear()

    def _terminate(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __del__(self):
        if hasattr(self, "_lock"):  # (a constructor that raised left nothing to close)
            self.close()
