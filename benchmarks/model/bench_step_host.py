"""Host time of one scheduled decode step before its forward: the runner's `StepBatch` from the C++
scheduler's output plus the step metadata (ids checked, tables checked, per-token tensors loaded into the
runner's persistent buffers), on the CPU. The GPU decode step is host-bound at small batch: this is the
part of it the runtime owns.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from deepinfer_model import StepBatch
from deepinfer_model.runtime.metadata import StepMetadata
from deepinfer_model.runtime.step_buffers import StepBuffers
from deepinfer_sched import Scheduler, SchedulerConfig

BLOCK, BLOCKS, VOCAB = 16, 4096, 1000


def decode_step(batch: int, prompt_len: int):
    """A scheduler's first decode step after every sequence's prompt."""
    sched = Scheduler(
        SchedulerConfig(
            block_size=BLOCK,
            num_blocks=BLOCKS,
            max_num_seqs=max(batch, 1),
            max_num_batched_tokens=batch * prompt_len,
            max_model_len=4096,
            enable_chunked_prefill=True,
            num_speculative_tokens=0,
            enable_prefix_caching=False,
        )
    )
    for i in range(batch):
        prompt = (np.arange(prompt_len, dtype=np.int32) + i) % (VOCAB - 4) + 4
        sched.add_request(prompt, seq_id=i, max_tokens=64, eos_token_id=None, ignore_eos=True)
    out = sched.schedule()
    sched.update_from_output(out, (np.full(batch, 7, dtype=np.int32), np.ones(batch, dtype=np.int32)))
    return sched.schedule()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--iters", type=int, default=3000)
    args = p.parse_args()
    buffers = StepBuffers(torch.device("cpu"))
    for batch in args.batches:
        out = decode_step(batch, args.prompt_len)

        def one(out=out):
            step = StepBatch.from_scheduler_output(out)
            return StepMetadata.build(step, BLOCK, BLOCKS, None, VOCAB, buffers)

        for _ in range(args.iters // 10):
            one()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            one()
        print(
            f"batch {batch}: {(time.perf_counter() - t0) / args.iters * 1e6:.1f} us per scheduled decode step"
        )


if __name__ == "__main__":
    main()
