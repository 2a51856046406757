"""Requests with images on prefill / decode disaggregation: the PROMPT engine expands and encodes the images
and prefills; the hand-off carries the image positions and digests, so the COMPLETION engine takes the
prompt's sentinel ids and keys its blocks by the images. Outputs equal a NORMAL engine's."""

import pytest
from deepinfer import LLM, EngineArgs, LLMEngine, SamplingParams
from deepinfer.engine.handoff import HandoffRecord
from image_common import png
from outputs_common import assert_same, assert_same_by_id

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
KW = dict(block_size=4, max_model_len=96, num_kv_blocks=96, max_num_seqs=4, async_scheduling=False)
IMAGES = [png(0), png(1, (84, 42))]
REQUESTS = [
    ("a<image>b", [IMAGES[0]]),
    ("x<image>y<image>z", IMAGES),
    ("a<image>b", [IMAGES[1]]),  # the first one's text with another image: no block in common
]


def normal(path):
    engine = LLMEngine(EngineArgs(model=str(path), **KW), num_speculative_tokens=0)
    for i, (text, images) in enumerate(REQUESTS):
        engine.add_request(str(i), text, GREEDY, multi_modal_data={"image": images})
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    engine.close()
    return outs


def test_prompt_then_completion_engine_with_images_equals_normal(vision_checkpoint):
    want = normal(vision_checkpoint)
    pe = LLMEngine(EngineArgs(model=str(vision_checkpoint), engine_type="prompt", **KW))
    ce = LLMEngine(
        EngineArgs(model=str(vision_checkpoint), engine_type="completion", stop_preempted_request=True, **KW)
    )
    for i, (text, images) in enumerate(REQUESTS):
        pe.add_request(str(i), text, GREEDY, multi_modal_data={"image": images})
    records = []
    while pe.has_unfinished_requests():
        for o in pe.step():
            assert o.error is None and [c.finish_reason for c in o.outputs] == ["prefilled"]
        records += [HandoffRecord.from_bytes(r.to_bytes()) for r in pe.take_handoffs()]
    assert all(r.meta["images"]["digests"] for r in records)
    for r in records:
        ce.add_handoff(r)
    got = {}
    while ce.has_unfinished_requests():
        got.update({o.request_id: o for o in ce.step()})
    pe.close()
    ce.close()
    assert_same_by_id(got, want)
    # the decode engine keys each request's blocks by its images: the same text with two images differs
    salts = {r.request_id: r.cache_salt for r in records}
    assert salts["0"] != salts["2"]


def test_a_hand_off_without_its_image_facts_is_refused(vision_checkpoint):
    """A record whose prompt holds sentinel ids but no image facts (e.g. from an older sender) fails its
    request alone, naming the ids."""
    pe = LLMEngine(EngineArgs(model=str(vision_checkpoint), engine_type="prompt", **KW))
    ce = LLMEngine(
        EngineArgs(model=str(vision_checkpoint), engine_type="completion", stop_preempted_request=True, **KW)
    )
    pe.add_request("0", "a<image>b", GREEDY, multi_modal_data={"image": [IMAGES[0]]})
    records = []
    while pe.has_unfinished_requests():
        pe.step()
        records += pe.take_handoffs()
    (record,) = records
    record.meta.pop("images")
    with pytest.raises(ValueError, match="must be in"):
        ce.add_handoff(record)
    assert not ce.has_unfinished_requests()
    pe.close()
    ce.close()


@pytest.mark.slow
def test_the_disaggregated_front_serves_requests_with_images(vision_checkpoint):
    with LLM(str(vision_checkpoint), **KW) as llm:
        want = llm.generate(
            [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in REQUESTS], GREEDY, use_tqdm=False
        )
    with LLM(str(vision_checkpoint), disaggregation="shm", distributed_startup_timeout=300, **KW) as llm:
        reqs = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in REQUESTS]
        reqs.append({"prompt": "a<image>b", "multi_modal_data": {"image": [b"not an image"]}})
        got = llm.generate(reqs, GREEDY, use_tqdm=False, raise_on_error=False)
        # the front reserved each hand-off's expanded prompt, not its text: the decode engine sent none back
        assert llm.engine.sent_back == 0
    assert_same(got[:3], want)
    assert "multi_modal_data['image'][0]" in got[3].error
