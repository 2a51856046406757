"""Requests with images on attention data parallel + expert parallel ranks and on context-parallel ranks
(2 CPU processes): each rank expands and encodes the images of the requests routed to it, and every
request comes out as from the single-process engine; a bad image fails its request alone."""

import pytest
from deepinfer import LLM, AsyncLLM, SamplingParams
from image_common import png
from outputs_common import assert_same

pytestmark = pytest.mark.distributed

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
PARALLEL = dict(data_parallel_size=2, expert_parallel_size=2, block_size=4)


def requests(tmp_path):
    path = tmp_path / "c.png"
    path.write_bytes(png(2, (70, 42)))
    return [
        {"prompt": "a<image>b", "multi_modal_data": {"image": [png(0)]}},
        {"prompt_token_ids": [0, 67, 68]},
        {"prompt": "x<image>y<image>z", "multi_modal_data": {"image": [png(1, (84, 42)), str(path)]}},
        {"prompt": "a<image>b", "multi_modal_data": {"image": [png(0)]}},  # the first one's image again
        {"prompt": "q<image>", "multi_modal_data": {"image": [png(3)]}},
    ]


def test_images_on_data_and_expert_parallel_ranks_equal_one_engine(vision_checkpoint, tmp_path):
    reqs = requests(tmp_path)
    with LLM(str(vision_checkpoint), block_size=4) as llm:
        want = llm.generate(reqs, GREEDY, use_tqdm=False)
    with LLM(str(vision_checkpoint), **PARALLEL) as llm:
        assert type(llm.engine).__name__ == "DataParallelEngine"
        got = llm.generate(reqs, GREEDY, use_tqdm=False)
        # a bad image fails its request alone, on the rank (undecodable) or at the front (unreadable)
        bad = llm.generate(
            [
                {"prompt": "a<image>b", "multi_modal_data": {"image": [b"not an image"]}},
                {"prompt": "a<image>b", "multi_modal_data": {"image": [str(tmp_path / "missing.png")]}},
                reqs[0],
            ],
            GREEDY,
            use_tqdm=False,
            raise_on_error=False,
        )
    assert_same(got, want)
    assert sum(t >= 256 for t in got[0].prompt_token_ids) > 0  # the expanded prompt is reported
    assert "multi_modal_data['image'][0]" in bad[0].error
    assert "cannot read the image file" in bad[1].error
    assert_same([bad[2]], [want[0]])


def test_images_on_context_parallel_ranks_equal_one_engine(vision_checkpoint, tmp_path):
    """Both ranks of a context-parallel group encode the group's images; each embeds the image positions
    among the rows it computes (a budget of 6 tokens per step cuts every image block across chunks)."""
    reqs = requests(tmp_path)
    with LLM(str(vision_checkpoint), block_size=4, max_num_batched_tokens=6) as llm:
        want = llm.generate(reqs, GREEDY, use_tqdm=False)
    with LLM(str(vision_checkpoint), context_parallel_size=2, block_size=4, max_num_batched_tokens=6) as llm:
        assert llm.engine.layout.cp == 2
        got = llm.generate(reqs, GREEDY, use_tqdm=False)
    assert_same(got, want)


def test_async_llm_streams_requests_with_images_from_the_ranks(vision_checkpoint, tmp_path):
    import asyncio

    reqs = requests(tmp_path)[:3]
    with LLM(str(vision_checkpoint), block_size=4) as llm:
        want = llm.generate(reqs, GREEDY, use_tqdm=False)

    async def serve():
        async with AsyncLLM(str(vision_checkpoint), **PARALLEL) as engine:

            async def one(req):
                last = None
                async for out in engine.generate(
                    req.get("prompt"),
                    GREEDY,
                    prompt_token_ids=req.get("prompt_token_ids"),
                    multi_modal_data=req.get("multi_modal_data"),
                ):
                    last = out
                return last

            return await asyncio.gather(*(one(r) for r in reqs))

    got = asyncio.run(serve())
    for g, w in zip(got, want):
        assert g.error is None and g.outputs[0].token_ids == w.outputs[0].token_ids
