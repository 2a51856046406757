"""Section 5: DSpark draft acceptance at nextn 1..5 and the confidence head's calibration.

Workload: the held-out code prompts of section 3, each continued for `tokens` tokens (`ignore_eos`,
`seq_seed` = prompt index) by `deepinfer.LLM` built under `DEEPINFER_USE_NEXTN_DECODE=n`, greedy and at
temperature 1 (no top-p / top-k). Every number comes from the engine's own accounting
(`LLMEngine.spec_stats()`, i.e. `deepinfer_spec.SpecStats`), over the decode steps that verified drafts:

* `accept_rate_pJ`: share of the drafts at position J that were accepted (prefix rule: an accepted draft
  follows accepted ones), `accepted_tokens_per_step` = 1 + mean accepted drafts per request-step (the
  bonus token counted), `verified_len_mean` = drafts verified per request-step;
* `confidence_abs_error_mean` and `confidence_ece`: the confidence head's predicted acceptance of each
  verified draft against its accept probability (exactly 1 / 0 under greedy verification: the realised
  outcome of that draft's own test; under sampling Σ min(p, q), its expectation); ECE with 10 equal-width
  bins, whose counts and means are the `dspark_reliability` records (the reliability diagram).

`varlen` repeats nextn 5 greedy with `DEEPINFER_ENABLE_MTP_VARLEN=1` (the default): `verified_len_mean` is
then the length the draft policy chose from the calibrated confidences (0 where it backed off a drafter
that does not pay). Greedy runs must emit the same tokens at every nextn
(`same_tokens_as_first_greedy`). Wall times are the host's (CPU runs measure correctness, not speed).
"""

from __future__ import annotations

import time
from pathlib import Path

from card_common import Records
from tqdm import tqdm


def one_config(
    model: Path, prompts, nextn: int, temperature: float, varlen: bool, tokens: int, device, max_len: int
):
    from deepinfer import LLM, SamplingParams
    from deepinfer.bench.engine_driver import environment
    from deepinfer.reproducibility import nextn_decode

    with nextn_decode(nextn), environment("DEEPINFER_ENABLE_MTP_VARLEN", "1" if varlen else "0"):
        llm = LLM(model=str(model), device=device, max_model_len=max_len)
    try:
        if llm.engine.num_speculative_tokens != nextn:
            raise ValueError(f"the engine drafts {llm.engine.num_speculative_tokens} tokens, asked {nextn}")
        params = [
            SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seq_seed=i)
            for i in range(len(prompts))
        ]
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        wall = time.perf_counter() - t0
        stats = llm.engine.spec_stats()
    finally:
        llm.close()
    for o in outs:
        if o.error is not None:
            raise RuntimeError(f"request {o.request_id} failed: {o.error}")
    return [o.outputs[0].token_ids for o in outs], stats, wall


def run(model: Path, prompts: list[list[int]], records: Records, counts: dict, device) -> None:
    prompts = prompts[: counts["dspark_prompts"]]
    tokens = counts["dspark_tokens"]
    max_len = max(map(len, prompts)) + tokens + 8  # + the draft rows of the last step
    configs = [(n, t, False) for t in (0.0, 1.0) for n in counts["nextn"]] + [
        (max(counts["nextn"]), 0.0, True)
    ]
    first_greedy = None
    for nextn, temperature, varlen in tqdm(configs, desc="DSpark configurations", unit="config"):
        out, s, wall = one_config(model, prompts, nextn, temperature, varlen, tokens, device, max_len)
        same = None
        if temperature == 0.0:
            first_greedy = first_greedy or out
            same = out == first_greedy
        per_position = {f"accept_rate_p{j + 1}": r for j, r in enumerate(s["accept_rate_per_position"])}
        records.add(
            "dspark",
            nextn=nextn,
            temperature=temperature,
            varlen=varlen,
            prompts=len(prompts),
            new_tokens_per_prompt=tokens,
            request_steps=s["request_steps"],
            drafts_verified=s["verified"],
            drafts_accepted=s["accepted"],
            **per_position,
            accept_rate=s["avg_accept_rate"],
            accepted_tokens_per_step=s["tokens_per_request_step"],
            verified_len_mean=s["avg_verified_len"],
            confidence_abs_error_mean=s["avg_confidence_error"],
            confidence_ece=s["confidence_ece"],
            same_tokens_as_first_greedy=same,
            wall_s=wall,
            draft_s=s["draft_s"],
        )
        for b in s["confidence_reliability"]:
            records.add(
                "dspark_reliability",
                nextn=nextn,
                temperature=temperature,
                varlen=varlen,
                confidence_from=b["low"],
                confidence_to=b["high"],
                drafts=b["count"],
                confidence_mean=b["mean_confidence"],
                accept_prob_mean=b["mean_accept_prob"],
            )
