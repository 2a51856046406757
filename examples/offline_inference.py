"""Offline inference with DeepInfer on any parallel layout.

One process (the built-in deepinfer-tiny when no model is given):
    python examples/offline_inference.py
Expert parallel over 2 ranks that this script spawns on this host:
    python examples/offline_inference.py --ep 2
The same ranks started by the launcher, or by torchrun (one host or several: the same variables):
    deepinfer launch --nproc 2 -- python examples/offline_inference.py --ep 2
    torchrun --nproc-per-node 2 examples/offline_inference.py --ep 2
Data parallel groups of expert-parallel ranks, context parallel prefill (V4.1 checkpoints):
    deepinfer launch --nproc 4 -- python examples/offline_inference.py --ep 2 --dp 4
    deepinfer launch --nproc 2 -- python examples/offline_inference.py --ep 2 --cp 2
    python examples/offline_inference.py --cp 2 --dp 2      # spawned here: 2 groups of 2 CP ranks

The sizes are derived as the reference derives them: with --ep N alone, data_parallel_size =
max(1, N // cp) (or the launched world size / cp). In a launched world every rank runs this script with
the same prompts and gets every output; rank 0 prints them.
"""

from __future__ import annotations

import argparse

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "1, 1, 2, 3, 5, 8,",
    "The three laws of thermodynamics are",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint directory (default: deepinfer-tiny)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--dp", type=int, default=0, help="data-parallel size (0: derived)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    llm = LLM(
        args.model,
        expert_parallel_size=args.ep,
        data_parallel_size=args.dp,
        context_parallel_size=args.cp,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    if getattr(llm.engine, "rank", 0) == 0:  # a launched world: every rank holds the outputs
        for out in outputs:
            print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    llm.close()


if __name__ == "__main__":
    main()
