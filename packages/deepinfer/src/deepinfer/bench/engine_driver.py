"""Driving an `LLMEngine` through its public API only (add_request / step / abort_all / stats), so the
harness measures whatever runner (recompute, paged) and loop (sync, async) the engine was built with."""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from pathlib import Path

from ..sampling_params import SamplingParams


class Driver:
    def __init__(self, engine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self._next = 0

    def random_prompt(self, length: int) -> list[int]:
        # Fresh random ids: no two prompts share a prefix, so prefix-cache hits happen only where intended.
        return [self.rng.randrange(3, self.engine.vocab_size) for _ in range(length)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        rid = f"bench-{self._next}"
        self._next += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.engine.add_request(rid, None, params, prompt_token_ids=prompt)
        return rid

    def run_until_done(self, request_ids: set[str], max_steps: int = 100_000) -> int:
        """Step until every request in `request_ids` finished; returns the steps taken."""
        left = set(request_ids)
        for step in range(1, max_steps + 1):
            for out in self.engine.step():
                if out.error:
                    raise RuntimeError(f"benchmark request {out.request_id} failed: {out.error}")
                left.discard(out.request_id)
            if not left:
                return step
        raise RuntimeError(f"requests {sorted(left)} did not finish in {max_steps} steps")

    def drain(self) -> None:
        self.engine.abort_all()
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def running(self) -> int:
        return int(self.engine.scheduler_stats().get("num_running", 0))

    def waiting(self) -> int:
        return int(self.engine.scheduler_stats().get("num_waiting", 0))


@contextmanager
def environment(name: str, value: str | None):
    """The environment variable `name` set to `value` (None: unset) inside the block, restored after: the
    engine reads its settings when it is built, so a benchmark builds each setting's engine inside one."""
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextmanager
def profiled(path: Path | None, stacks: bool = False):
    """torch profiler around the block when `path` is given (chrome trace written there on exit); `stacks`:
    with Python frames (the tracer slows the host a little, so the host-bound gaps it shows grow too)."""
    if path is None:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities, record_shapes=False, with_stack=stacks) as prof:
        yield
    # a readable summary beside the trace: the ops that take the host's and the device's time (computed
    # before the export, which leaves the profiler's event list empty)
    device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    averages = prof.key_averages()
    summary = "\n\n".join(
        averages.table(sort_by=k, row_limit=30) for k in ("self_cpu_time_total", device_key)
    )
    prof.export_chrome_trace(str(path))
    path.with_suffix(".txt").write_text(summary)
