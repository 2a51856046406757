"""Images prepared off the engine's thread: `ImageInputs.prepare` gives the same expanded prompt, embeddings
and errors as the direct path, and `AsyncLLM` keeps stepping other requests while an image decodes; a
preprocessing timeout fails that request alone."""

import asyncio
import io
import re

import pytest
import torch
from deepinfer import LLM, AsyncLLM, EngineArgs, LLMEngine, SamplingParams
from deepinfer.engine.images import PreparedImages
from deepinfer_model.models.deepseek_v41.vision import image_digest
from image_common import png
from PIL import Image

ENGINE = dict(block_size=4, max_num_batched_tokens=6)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TEXT_IDS = [0, 67, 68]


@pytest.fixture(scope="module")
def huge_png() -> bytes:
    """64 M pixels: tiny when compressed, long to decode and resize however the threads are scheduled."""
    buf = io.BytesIO()
    Image.new("RGB", (8000, 8000), (40, 80, 120)).save(buf, format="PNG")
    return buf.getvalue()


def _engine(checkpoint, **kw) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(checkpoint), **ENGINE, **kw))


def _same_prompt(got, want) -> None:
    assert got.ids == want.ids and got.digests == want.digests
    assert (got.rows == want.rows).all() and (got.sentinel == want.sentinel).all()
    assert torch.equal(got.features, want.features)


def test_prepared_path_equals_direct_path(vision_checkpoint, share_loaded_models):
    a, b = png(30), png(31, (84, 42))
    direct_engine = _engine(vision_checkpoint)
    one = direct_engine.model.vision.config
    rows = (56 // one.merged_pixels) ** 2  # the encoder cache holds a (2 x 2 cells) or b, not both
    engine = _engine(vision_checkpoint, encoder_cache_tokens=max(rows, 6))
    try:
        images, direct = engine.images, direct_engine.images

        def both(prompt, ids, mm):
            prepared = images.prepare(mm)
            assert isinstance(prepared, PreparedImages)
            return (
                images.prompt(prompt, ids, prepared, engine.encode, engine.tokenizer),
                direct.prompt(prompt, ids, mm, direct_engine.encode, direct_engine.tokenizer),
            )

        _same_prompt(*both("a<image>!<image>b", None, {"image": [a, b]}))
        # a cached when prepared (not preprocessed then), evicted by b before admission: preprocessed there
        _same_prompt(*both("x<image>", None, {"image": [a]}))
        prepared = images.prepare({"image": [a]})
        assert prepared.prepared == [None]
        images.prompt("y<image>", None, {"image": [b]}, engine.encode, engine.tokenizer)
        assert image_digest(a) not in images.encoder_cache
        got = images.prompt("x<image>", None, prepared, engine.encode, engine.tokenizer)
        _same_prompt(got, direct.prompt("x<image>", None, {"image": [a]}, engine.encode, engine.tokenizer))
        placeholder = images.placeholder_id
        _same_prompt(*both(None, [0, placeholder, 67], {"image": [b]}))

        bad = [
            ("a<image>b", None, {"image": [b"not an image"]}),
            ("a<image>b", None, {"image": [a, a]}),
            ("a<image>b", None, {"image": [17]}),
            ("a<image>b", None, {"image": [b"junk", 17]}),
            ("ab", None, {"image": [a]}),
            ("a<image>b", None, {"video": [a]}),
            ("a<image>b", None, {"image": []}),
            ("a<image>b", None, ["not a dict"]),
            ("a<image>", None, {"image": ["/no/such/image.png"]}),
            (None, [0, placeholder, placeholder], {"image": [a]}),
        ]
        for prompt, ids, mm in bad:
            with pytest.raises(ValueError) as want:
                direct.prompt(prompt, ids, mm, direct_engine.encode, direct_engine.tokenizer)
            with pytest.raises(ValueError) as got:
                images.prompt(prompt, ids, images.prepare(mm), engine.encode, engine.tokenizer)
            assert (type(got.value), _message(got.value)) == (type(want.value), _message(want.value)), mm
    finally:
        engine.close()
        direct_engine.close()


def _message(error: Exception) -> str:
    """The error's text without object addresses (Pillow names the BytesIO it could not read)."""
    return re.sub(r"0x[0-9a-f]+", "0x?", str(error))


async def _tokens(llm: AsyncLLM, **kw) -> list[int]:
    outs = [out async for out in llm.generate(**kw)]
    assert outs[-1].finished and outs[-1].error is None, outs[-1].error
    return outs[-1].outputs[0].token_ids


def test_text_steps_go_on_while_an_image_decodes(vision_checkpoint, share_loaded_models, huge_png):
    """Deliveries (one per engine step at most) that a text request gets between the image request's
    submission and its admission: with admission blocked on the decode it is at most the one step in
    flight; prepared off the thread, the steps go on."""
    long_text = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with LLM(model=str(vision_checkpoint), **ENGINE) as offline:
        text_solo = offline.generate(prompt_token_ids=TEXT_IDS, sampling_params=long_text, use_tqdm=False)
        image_solo = offline.generate(
            {"prompt": "a<image>b", "multi_modal_data": {"image": [huge_png]}}, GREEDY, use_tqdm=False
        )

    async def run():
        deliveries: list[int] = []  # per delivery to the text request: its tokens so far
        async with AsyncLLM.from_engine(_engine(vision_checkpoint)) as llm:
            llm.listeners.append(
                lambda out, new, gap, now: (
                    deliveries.append(len(out.outputs[0].token_ids))
                    if out.request_id == "text" and new > 0
                    else None
                )
            )
            text = asyncio.create_task(
                _tokens(llm, prompt_token_ids=TEXT_IDS, sampling_params=long_text, request_id="text")
            )
            while not deliveries:  # the text request is decoding
                await asyncio.sleep(0.001)
            before = len(deliveries)
            stream = await llm.add_request(
                "a<image>b", GREEDY, "image", multi_modal_data={"image": [huge_png]}
            )
            during = len(deliveries) - before
            image_out = [out async for out in stream][-1]
            return during, await text, image_out

    during, text_tokens, image_out = asyncio.run(run())
    assert during >= 3, during
    assert text_tokens == text_solo[0].outputs[0].token_ids
    assert image_out.error is None
    assert image_out.prompt_token_ids == image_solo[0].prompt_token_ids
    assert image_out.outputs[0].token_ids == image_solo[0].outputs[0].token_ids


def test_preprocessing_timeout_fails_only_that_request(vision_checkpoint, share_loaded_models, huge_png):
    small = png(32)
    with LLM(model=str(vision_checkpoint), **ENGINE) as offline:
        text_solo = offline.generate(prompt_token_ids=TEXT_IDS, sampling_params=GREEDY, use_tqdm=False)[0]
        small_solo = offline.generate(
            {"prompt": "a<image>b", "multi_modal_data": {"image": [small]}}, GREEDY, use_tqdm=False
        )[0]

    async def run():
        async with AsyncLLM.from_engine(_engine(vision_checkpoint)) as llm:
            # the workers are up (their start is not what the timeout is about)
            await _tokens(
                llm, prompt="a<image>b", sampling_params=GREEDY, multi_modal_data={"image": [png(33)]}
            )
            pre = llm.engine.images.preprocessor
            pre.timeout_s = 1e-4  # decoding 64 M pixels takes far longer
            text = asyncio.create_task(_tokens(llm, prompt_token_ids=TEXT_IDS, sampling_params=GREEDY))
            with pytest.raises(ValueError) as late:
                await llm.add_request("a<image>b", GREEDY, multi_modal_data={"image": [huge_png]})
            pre.timeout_s = 120
            again = await _tokens(
                llm, prompt="a<image>b", sampling_params=GREEDY, multi_modal_data={"image": [small]}
            )
            return str(late.value), await text, again

    error, text_tokens, again = asyncio.run(run())
    assert error == "multi_modal_data['image'][0]: preprocessing did not finish within 0.0001 s"
    assert text_tokens == text_solo.outputs[0].token_ids
    assert again == small_solo.outputs[0].token_ids  # the replaced pool prepares the next image
