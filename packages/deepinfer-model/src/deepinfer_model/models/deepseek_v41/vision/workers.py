"""Image preprocessing off the engine thread: a pool of worker processes, each job with a deadline.

Decoding and resizing are CPU-heavy and Pillow holds the GIL for parts of them, so they run in separate
processes (spawned: the parent may hold torch threads that a fork would copy mid-state). The deadline is on
progress, as the reference's: while the workers go `DEEPINFER_MULTI_MODAL_WORKER_TIMEOUT` seconds without
finishing an image, the images still waiting fail with an `ImageError` and the pool is replaced, so one
stuck decode costs its own requests, not the process (the reference aborts the process instead). A batch
of many images (an offline `generate` prepares all of its requests' images in one call) therefore gets as
long as it keeps finishing images, and one image never more than the timeout beyond the last finished.

`prepare` may be called from several threads (an engine prepares a request's images on a thread of its own
while its step loop runs): calls take turns on one lock, because replacing the pool of a stuck job would
cut off another call's jobs. `close` from any thread ends a call still waiting within a tenth of a second.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable

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
        self.batches = self.images_sent = 0  # prepare calls and the images they sent to the workers
        self._lock = threading.RLock()
        self._closing = threading.Event()

    def _ensure_pool(self):
        if self._pool is None:
            self._pool = multiprocessing.get_context("spawn").Pool(self.workers)
        return self._pool

    def prepare(
        self,
        images: list[bytes],
        labels: list[str] | None = None,
        on_done: Callable[[int], None] | None = None,
    ) -> list[PreparedImage | ImageError]:
        """on_done(n): called with the number of images newly finished (for a progress bar)."""
        labels = labels or [f"image {i}" for i in range(len(images))]
        with self._lock:
            timeout_s = self.timeout_s
            pool = self._ensure_pool()
            self.batches += 1
            self.images_sent += len(images)
            jobs = [
                pool.apply_async(_job, (data, self.vcfg, label))
                for data, label in zip(images, labels, strict=True)
            ]
            unseen = set(range(len(jobs)))  # jobs not yet seen finished; the deadline moves on as it shrinks
            deadline = time.monotonic() + timeout_s

            def progress(done: list[int]) -> None:
                nonlocal deadline
                done = [j for j in done if j in unseen]
                if done:
                    unseen.difference_update(done)
                    deadline = time.monotonic() + timeout_s
                    if on_done is not None:
                        on_done(len(done))

            out: list[PreparedImage | ImageError] = []
            stuck = False
            for i, (job, label) in enumerate(zip(jobs, labels, strict=True)):
                while not job.ready() and not self._closing.is_set():
                    progress([j for j in unseen if jobs[j].ready()])
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    job.wait(min(left, 0.1))
                if job.ready():
                    progress([i])
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
