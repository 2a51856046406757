"""Decode perplexity of one sample, and running a workload through `LLM`.

Definition (what the baseline file stores). For a prompt x and the completion y_1..y_N that the engine
generates greedily (temperature 0, ignore_eos, the workload's seq_seed):

    decode_ppl = exp( -(1/N) * sum_t log p(y_t | x, y_<t) )

where p is the softmax of the model's FP32 logits at that step before any sampling transform
(temperature, top-p/k, penalties) — the per-token `logprobs` the engine reports. It is the perplexity
of the model on its own greedy continuation: it moves when the logits move (numerics) and jumps when a
greedy choice flips (a numerics change big enough to change behaviour).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from contextlib import contextmanager

from .workloads import PplWorkload


def decode_ppl(logprobs: Sequence[float]) -> float:
    if len(logprobs) == 0:
        raise ValueError("logprobs must hold at least one generated token")
    return math.exp(-math.fsum(logprobs) / len(logprobs))


def tokens_digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


@contextmanager
def nextn_decode(n: int):
    """DEEPINFER_USE_NEXTN_DECODE=n while the block runs. The engine fixes its draft count when it is
    built, so build the workload's `LLM` inside this block: `with nextn_decode(w.nextn): llm = LLM(...)`.
    0 is set explicitly too: a checkpoint with draft blocks drafts 5 tokens when the variable is unset."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    before = os.environ.get("DEEPINFER_USE_NEXTN_DECODE")
    os.environ["DEEPINFER_USE_NEXTN_DECODE"] = str(n)
    try:
        yield
    finally:
        if before is None:
            del os.environ["DEEPINFER_USE_NEXTN_DECODE"]
        else:
            os.environ["DEEPINFER_USE_NEXTN_DECODE"] = before


def run_workload(llm, workload: PplWorkload) -> dict:
    """Generate the workload with `llm` (a `deepinfer.LLM` built under `nextn_decode(workload.nextn)`);
    returns the baseline record: the workload's shape, per-sample `ppl`, and per-sample digests of the
    generated token ids. Raises ValueError when the engine drafts a different number of tokens than the
    workload says (the record would name a draft count that did not run)."""
    from ..sampling_params import SamplingParams

    drafts = getattr(llm.engine, "num_speculative_tokens", None)  # None: an engine that cannot tell
    if drafts is not None and drafts != workload.nextn:
        raise ValueError(
            f"workload {workload.name}: nextn is {workload.nextn} but the engine drafts {drafts} tokens "
            f"per step: build the LLM inside nextn_decode({workload.nextn})"
        )

    vocab = int(llm.engine.vocab_size)
    prompts = workload.prompts(vocab)
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=workload.output_len,
            ignore_eos=True,
            logprobs=0,
            seq_seed=workload.seq_seed(i),
        )
        for i in range(len(prompts))
    ]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    ppl, digests = [], []
    for out in outputs:
        if out.error is not None:
            raise RuntimeError(f"workload {workload.name}: request {out.request_id} failed: {out.error}")
        completion = out.outputs[0]
        if len(completion.token_ids) != workload.output_len:
            raise RuntimeError(
                f"workload {workload.name}: got {len(completion.token_ids)} tokens, expected {workload.output_len}"
            )
        ppl.append(decode_ppl(completion.token_logprobs))
        digests.append(tokens_digest(completion.token_ids))
    return workload.describe() | {"model": model_tag(llm), "ppl": ppl, "tokens_sha256": digests}


def model_tag(llm) -> str:
    """What the record was measured with, independent of where the checkpoint lives: the model class
    and the config sizes that change its numbers (a baseline is keyed by platform, not model path)."""
    engine = getattr(llm, "engine", llm)
    cfg = engine.model.config
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "vocab_size")
    sizes = ",".join(f"{k}={getattr(cfg, k, None)}" for k in keys)
    return f"{type(engine.model).__name__}({sizes})"


def compare(baseline: dict, measured: dict, rtol: float) -> list[str]:
    """Problems found comparing `measured` with `baseline` sample by sample (empty list: they agree)."""
    problems = []
    if "model" in baseline and baseline["model"] != measured.get("model"):
        problems.append(f"model: baseline {baseline['model']} != measured {measured.get('model')}")
    for key in ("num_prompts", "input_len", "output_len", "nextn"):
        if baseline.get(key) != measured.get(key):
            problems.append(f"{key}: baseline {baseline.get(key)} != measured {measured.get(key)}")
    if problems:
        return problems + ["the workload changed: refresh the baseline (--refresh-ppl-baseline)"]
    for i, (b, m) in enumerate(zip(baseline["ppl"], measured["ppl"], strict=True)):
        if not math.isclose(b, m, rel_tol=rtol, abs_tol=0.0):
            problems.append(f"sample {i}: decode PPL {m:.6g} vs baseline {b:.6g} (rtol {rtol:g})")
    return problems
