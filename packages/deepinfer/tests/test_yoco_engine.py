"""YoCo prefill truncation end to end in the engine, on the random-weight §11 tiny V4.1 (W = 8).

Reference: the stateless model `model.forward(tokens, yoco_keep_tokens=K, yoco_mode=..., yoco_prompt_len=P)`
teacher-forced on the engine's generated sequence — its greedy choice at every generated position must be
the token the engine emitted, through chunked prefill, preemption (recompute) and draft rollback.
"""

import pytest
import torch
from deepinfer import SamplingParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

MODE = "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"
KEEP = "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"
# Longer than KEEP (truncated), one shorter than KEEP (nothing to truncate); W = 8.
PROMPTS = [
    [(7 * i + 3) % 256 for i in range(30)],
    [(11 * i + 5) % 256 for i in range(21)],
    [1, 2, 3, 4, 5, 6],
]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    path = make_v41_checkpoint(tmp_path_factory.mktemp("v41-yoco"), seed=3)
    return path


@pytest.fixture
def yoco_env(monkeypatch):
    def set_env(mode: str | None, keep: int | None = None, backtracking: int | None = None) -> None:
        for name, value in ((MODE, mode), (KEEP, keep), ("DEEPINFER_MAX_BACKTRACKING_TOKENS", backtracking)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, str(value))

    return set_env


def run(path, prompts=PROMPTS, nextn=0, params=GREEDY, **kw):
    kw.setdefault("max_model_len", 48)
    kw.setdefault("block_size", 16)
    engine = LLMEngine(EngineArgs(model=str(path), **kw), num_speculative_tokens=nextn)
    for j, prompt in enumerate(prompts):
        engine.add_request(str(j), None, params, prompt_token_ids=prompt)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    engine.close()
    return [outs[str(j)].outputs[0].token_ids for j in range(len(prompts))], engine


def stateless_greedy_matches(model, prompt, generated, keep, mode, backtracking=1) -> None:
    """The stateless truncated forward, teacher-forced on prompt + generated, picks every generated token."""
    seq = torch.tensor(prompt + generated[:-1])
    kw = {}
    if mode is not None:
        kw = dict(
            yoco_keep_tokens=keep,
            yoco_mode=mode,
            yoco_prompt_len=len(prompt),
            backtracking_tokens=backtracking,
        )
    logits = model.forward(seq, **kw).logits[-len(generated) :]
    assert logits.argmax(-1).tolist() == list(generated)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mask_and_compact_generate_the_stateless_truncated_tokens(v41, yoco_env, async_scheduling):
    results = {}
    for mode in ("mask", "compact"):
        yoco_env(mode, 10)
        tokens, engine = run(v41, async_scheduling=async_scheduling)
        for prompt, gen in zip(PROMPTS, tokens):
            assert len(gen) == 8
            stateless_greedy_matches(engine.model, prompt, gen, 10, mode)
        results[mode] = (tokens, engine.stats.prefill_flops)
    assert results["mask"][0] == results["compact"][0]
    yoco_env("off")
    off_tokens, off_engine = run(v41, async_scheduling=async_scheduling)
    # compact skips consumer rows, mask only clips SWA visibility: strictly fewer FLOPs in that order.
    assert 0 < results["compact"][1] < results["mask"][1] < off_engine.stats.prefill_flops


def test_chunked_prefill_and_preemption_give_the_same_tokens(v41, yoco_env):
    yoco_env("compact", 10)
    reference, _ = run(v41)
    # 7-token chunks: the 30-token prompt's first chunks lie wholly before rect_lo = 20 (placeholder rows).
    chunked, _ = run(v41, block_size=4, max_num_batched_tokens=7)
    assert chunked == reference
    # 4 blocks of 16 for three sequences that each grow to 3 blocks: some are preempted and recompute
    # (prompt + outputs) under their original prompt length.
    preempted, engine = run(v41, num_kv_blocks=4)
    assert engine.scheduler_stats()["num_preemptions"] > 0
    assert preempted == reference


def test_rollback_of_rejected_drafts_under_truncation(v41, yoco_env):
    yoco_env("compact", 12)  # B = drafts + 1 = 3, W + B = 11
    drafted, engine = run(v41, nextn=2)
    stats = engine.spec_stats()
    assert 0 <= stats["accepted"] < stats["verified"]  # some drafts were rejected and rolled back
    for prompt, gen in zip(PROMPTS, drafted):
        stateless_greedy_matches(engine.model, prompt, gen, 12, "compact", backtracking=3)


def test_keep_check_at_engine_start_names_both_sides(v41, yoco_env):
    yoco_env("compact", 8)  # W + B = 8 + 1
    with pytest.raises(ValueError, match=r"KEEP_TOKENS = 8 must be >= sliding_window W .* = 8 \+ 1 = 9"):
        LLMEngine(EngineArgs(model=str(v41), block_size=16, max_model_len=48))
    yoco_env("mask", 10, backtracking=4)  # B = max(4, 0 + 1)
    with pytest.raises(ValueError, match=r"= 10 must be >= .* = 8 \+ 4 = 12"):
        LLMEngine(EngineArgs(model=str(v41), block_size=16, max_model_len=48))
    yoco_env("compact", 10)
    with pytest.raises(ValueError, match=r"= 10 must be >= .* = 8 \+ 5 = 13"):
        LLMEngine(EngineArgs(model=str(v41), block_size=16, max_model_len=48), num_speculative_tokens=4)
    yoco_env("compact", 10)
    with pytest.raises(ValueError, match="needs runner = 'paged'"):
        LLMEngine(EngineArgs(model=str(v41), block_size=16, max_model_len=48, runner="recompute"))
    yoco_env("sideways", 10)
    with pytest.raises(ValueError, match="TRUNCATION_MODE"):
        LLMEngine(EngineArgs(model=str(v41), block_size=16, max_model_len=48))


def test_truncation_refused_on_a_model_without_yoco_split(micro_checkpoint, yoco_env):
    yoco_env("compact", 140)
    with pytest.raises(ValueError, match="YoCo split"):
        LLMEngine(EngineArgs(model=str(micro_checkpoint), block_size=16, max_model_len=48))


def test_prompt_logprobs_refused_per_request(v41, yoco_env):
    yoco_env("compact", 10)
    engine = LLMEngine(EngineArgs(model=str(v41), block_size=16, max_model_len=48))
    bad = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=True)
    with pytest.raises(ValueError, match="prompt_logprobs = True is not available with"):
        engine.add_request("bad", None, bad, prompt_token_ids=PROMPTS[0])
    engine.add_request("good", None, GREEDY, prompt_token_ids=PROMPTS[1])
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    engine.close()
    assert [o.request_id for o in outs] == ["good"] and len(outs[0].outputs[0].token_ids) == 8


def test_off_mode_is_the_untruncated_model_with_prefix_caching(v41, yoco_env):
    yoco_env(None)
    shared = PROMPTS[0][:20]
    prompts = [shared + [9, 9, 9], shared + [8, 8]]  # the second one hits the first one's full block
    tokens, engine = run(v41, prompts=prompts, max_num_seqs=1)  # one after the other
    for prompt, gen in zip(prompts, tokens):
        stateless_greedy_matches(engine.model, prompt, gen, None, None)
    assert engine.scheduler_stats()["prefix_cache_hit_tokens"] > 0
    assert engine.stats.prefill_flops > 0
    # Under truncation the same pair gets no hit (a hit from another prompt length would read consumer
    # SWA keys computed under another rect_lo: the prompt length salts the prefix cache) and still
    # decodes exactly.
    yoco_env("compact", 10)
    tokens, engine = run(v41, prompts=prompts, max_num_seqs=1)
    assert engine.scheduler_stats()["prefix_cache_hit_tokens"] == 0
    for prompt, gen in zip(prompts, tokens):
        stateless_greedy_matches(engine.model, prompt, gen, 10, "compact")


def test_truncation_keeps_prefix_hits_between_prompts_of_one_length(v41, yoco_env):
    yoco_env("compact", 10)
    shared = PROMPTS[0][:20]
    prompts = [shared + [9, 9, 9], shared + [8, 8, 8]]  # same length: same rect_lo, a safe hit
    tokens, engine = run(v41, prompts=prompts, max_num_seqs=1)
    assert engine.scheduler_stats()["prefix_cache_hit_tokens"] > 0
    for prompt, gen in zip(prompts, tokens):
        stateless_greedy_matches(engine.model, prompt, gen, 10, "compact")
