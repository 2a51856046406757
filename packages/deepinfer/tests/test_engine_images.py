"""Requests with images through the engine: `LLM.generate` with `multi_modal_data`, against the stateless
V4.1 forward with `image_features`, prefix caching keyed by the images, and per-request failures."""

import io

import pytest
import torch
from deepinfer import LLM, EngineArgs, LLMEngine, SamplingParams
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from deepinfer_model.models.deepseek_v41.vision import (
    ImageSentinels,
    compression_stride,
    expand_images,
    prepare_image,
)
from image_common import png
from PIL import Image

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(vision_checkpoint):
    # a token budget of 6 per step: every image block is cut across prefill chunks; the drafting loop
    # (the reference's 5 drafts per step; test_plain_decode_loops runs the other two)
    args = EngineArgs(model=str(vision_checkpoint), block_size=4, max_num_batched_tokens=6)
    with LLM.from_engine(LLMEngine(args, num_speculative_tokens=5)) as llm:
        assert llm.engine.spec is not None
        yield llm


def _reference(llm, texts: list[str], images: list[bytes], steps: int = 4) -> list[int]:
    """Greedy tokens of the stateless forward, the prompt expanded by hand from the same pieces."""
    engine, model = llm.engine, llm.engine.model
    vcfg = model.vision.config
    prepared = [prepare_image(b, vcfg) for b in images]
    feats = [
        model.vision.embed_image(torch.from_numpy(p.patches), p.patch_rows, p.patch_cols) for p in prepared
    ]
    segments = [engine.encode(texts[0])] + [
        engine.tokenizer.encode(t, add_special_tokens=False).ids for t in texts[1:]
    ]
    ids, _ = expand_images(
        segments,
        [(p.rows, p.cols) for p in prepared],
        compression_stride(model.config.compress_ratios),
        ImageSentinels(model.config.vocab_size),
    )
    out = []
    for _ in range(steps):
        logits = model.forward(ids, image_features=feats).logits
        out.append(int(torch.argmax(logits[-1])))
        ids = ids + [out[-1]]
    return out


def _request(text: str, *images) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}


def test_generate_with_images_equals_stateless_forward(llm, tmp_path):
    a, b = png(0), png(1, (84, 42))
    path = tmp_path / "b.png"
    path.write_bytes(b)
    pil = Image.open(io.BytesIO(a))
    outs = llm.generate(
        [_request("a<image>b", a), _request("a<image>!<image>b", pil, str(path))], GREEDY, use_tqdm=False
    )
    assert [o.error for o in outs] == [None, None]
    assert outs[0].outputs[0].token_ids == _reference(llm, ["a", "b"], [a])
    assert outs[1].outputs[0].token_ids == _reference(llm, ["a", "!", "b"], [a, b])
    vocab = llm.engine.vocab_size
    assert sum(t >= vocab for t in outs[0].prompt_token_ids) > 0  # the expanded prompt is reported


def test_generate_preprocesses_a_calls_images_in_one_batch_each_once(llm):
    """`LLM.generate` sends every request's images to the worker pool together, an image that several
    requests carry at the same place once, and the outputs are those of adding the requests one by one."""
    pre = llm.engine.images.preprocessor
    a, b, c = png(40), png(41, (42, 84)), png(42)
    batch = [_request("a<image>b", x) for x in (a, a, b, a, b)]
    batch.append(_request("a<image>!<image>b", c, a))
    batches, sent = pre.batches, pre.images_sent
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert (pre.batches - batches, pre.images_sent - sent) == (1, 4)  # a, b, c at [0]; a at [1]
    assert [o.error for o in outs] == [None] * 6
    assert outs[0].outputs[0].token_ids == _reference(llm, ["a", "b"], [a])
    assert outs[2].outputs[0].token_ids == _reference(llm, ["a", "b"], [b])
    assert outs[5].outputs[0].token_ids == _reference(llm, ["a", "!", "b"], [c, a])
    assert [o.outputs[0].token_ids for o in outs[:5]] == [
        outs[i].outputs[0].token_ids for i in (0, 0, 2, 0, 2)
    ]


def test_extra_placeholders_stay_text(llm):
    """Placeholders past the last image are tokenized as text (here outside the tiny model's 256-token
    vocabulary, so the expansion is checked directly and the request fails on its text ids)."""
    engine, a = llm.engine, png(2)
    expanded = engine.images.prompt("a<image>b<image>", None, {"image": [a]}, engine.encode, engine.tokenizer)
    tail = engine.tokenizer.encode("b<image>", add_special_tokens=False).ids
    assert len(tail) > 1 and expanded.ids[-len(tail) :] == tail
    assert expanded.ids[: len(engine.encode("a"))] == engine.encode("a")
    head = expanded.ids[: -len(tail)]  # BOS, "a", then one image block of sentinel ids
    assert sum(t >= engine.vocab_size for t in head) == len(head) - 2
    out = llm.generate([_request("a<image>b<image>", a)], GREEDY, use_tqdm=False, raise_on_error=False)[0]
    bad = len(expanded.ids) - len(tail) + next(i for i, t in enumerate(tail) if t >= engine.vocab_size)
    assert out.error.startswith(f"prompt_token_ids[{bad}]=")


def test_different_images_differ_same_image_shares_blocks(llm):
    engine = llm.engine
    a, b = png(3), png(4)
    before = engine.scheduler_stats()["prefix_cache_hit_tokens"]
    first = llm.generate([_request("a<image>b", a)], GREEDY, use_tqdm=False)[0]
    other = llm.generate([_request("a<image>b", b)], GREEDY, use_tqdm=False)[0]
    # same token ids (the sentinels do not name the image), different images: no block is shared
    assert first.prompt_token_ids == other.prompt_token_ids
    assert engine.scheduler_stats()["prefix_cache_hit_tokens"] == before
    assert first.outputs[0].token_ids != other.outputs[0].token_ids
    again = llm.generate([_request("a<image>b", a)], GREEDY, use_tqdm=False)[0]
    hits = engine.scheduler_stats()["prefix_cache_hit_tokens"] - before
    assert hits >= 4 * (len(first.prompt_token_ids) // 4 - 1)  # the full blocks of the prompt
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.images.encoder_cache.hits >= 1  # the image was encoded once


def test_bad_images_fail_alone(llm):
    good, text_params = png(5), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    batch = [
        _request("a<image>b", good),
        _request("a<image>b", b"not an image"),
        _request("a<image>b", good, good),  # two images, one placeholder
        _request("a<image>b", 17),
        _request("ab", good),
        {"prompt_token_ids": [0, 67, 68]},
    ]
    outs = llm.generate(batch, text_params, use_tqdm=False, raise_on_error=False)
    assert outs[0].error is None and outs[5].error is None
    assert "multi_modal_data['image'][0]: cannot decode the image bytes" in outs[1].error
    assert "has 2 images but the prompt has 1 <image> placeholders" in outs[2].error
    assert "must be bytes, a PIL image or a file path, got int" in outs[3].error
    assert "has 1 images but the prompt has 0 <image> placeholders" in outs[4].error
    solo = llm.generate([batch[0]], text_params, use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == solo.outputs[0].token_ids == _reference(llm, ["a", "b"], [good])
    text_solo = llm.generate(prompt_token_ids=[0, 67, 68], sampling_params=text_params, use_tqdm=False)[0]
    assert outs[5].outputs[0].token_ids == text_solo.outputs[0].token_ids
    missing = llm.generate(
        [_request("a<image>", "/no/such/image.png")], GREEDY, use_tqdm=False, raise_on_error=False
    )[0]
    assert "cannot read the image file '/no/such/image.png'" in missing.error


def test_sentinel_ids_only_with_images(llm):
    vocab = llm.engine.vocab_size
    out = llm.generate(
        prompt_token_ids=[0, 67, vocab + 2], sampling_params=GREEDY, use_tqdm=False, raise_on_error=False
    )[0]
    assert out.error == f"prompt_token_ids[2]={vocab + 2}: must be in [0, {vocab})"


def test_model_without_vision_tower_refuses_images(tmp_path):
    path = make_v41_checkpoint(tmp_path / "text-only", seed=0)
    with LLM(model=str(path), block_size=4) as llm:
        outs = llm.generate(
            [_request("a<image>b", png(6)), {"prompt_token_ids": [0, 67, 68]}],
            GREEDY,
            use_tqdm=False,
            raise_on_error=False,
        )
    assert "this model has no vision tower" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4


def test_chat_image_url_parts(llm, tmp_path):
    import base64

    a, b = png(7), png(8, (42, 70))
    path = tmp_path / "b.png"
    path.write_bytes(b)
    url = "data:image/png;base64," + base64.b64encode(a).decode()

    def conversation(second: str) -> list[dict]:
        parts = [
            {"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "image_url", "image_url": second},
            {"type": "text", "text": "b"},
        ]
        return [{"role": "user", "content": parts}]

    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]
    convs = [conversation(str(path)), bad, conversation(f"file://{path}")]
    outs = llm.chat(convs, GREEDY, use_tqdm=False, raise_on_error=False)
    assert "remote image URLs are not fetched" in outs[1].error
    from deepinfer.tokenizer import render_chat

    text = render_chat([{"role": "user", "content": "a<image><image>b"}], llm.engine.tokenizer_config, True)
    assert text == "a<image><image>b!"
    want = llm.generate([_request(text, a, b)], GREEDY, use_tqdm=False)[0]
    assert outs[0].error is None and outs[2].error is None and want.error is None
    assert outs[0].prompt_token_ids == outs[2].prompt_token_ids == want.prompt_token_ids
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids == want.outputs[0].token_ids


def test_cli_generate_image(llm, vision_checkpoint, tmp_path):
    import json

    from deepinfer.cli import main

    a = png(9)
    path = tmp_path / "a.png"
    path.write_bytes(a)
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(vision_checkpoint), "--prompt", "a<image>b", "--image", str(path)]
    argv += ["--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--output", str(out), "--no-progress"]
    assert main(argv) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["error"] is None
    assert record["outputs"][0]["token_ids"] == _reference(llm, ["a", "b"], [a])
    code = main(["generate", "--model", str(vision_checkpoint), "--input", str(out), "--image", str(path)])
    assert code != 0  # --image goes with --prompt only


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_plain_decode_loops(llm, vision_checkpoint, monkeypatch, async_scheduling):
    """Without drafting, in the synchronous and the asynchronous loop (the fixture's engine drafts)."""
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    a = png(10)
    with LLM(
        model=str(vision_checkpoint),
        block_size=4,
        max_num_batched_tokens=6,
        async_scheduling=async_scheduling,
    ) as plain:
        assert plain.engine.spec is None
        outs = plain.generate(
            [_request("a<image>b", a), {"prompt_token_ids": [0, 67, 68]}], GREEDY, use_tqdm=False
        )
    assert outs[0].outputs[0].token_ids == _reference(llm, ["a", "b"], [a])
    text = llm.generate(prompt_token_ids=[0, 67, 68], sampling_params=GREEDY, use_tqdm=False)[0]
    assert outs[1].outputs[0].token_ids == text.outputs[0].token_ids


def test_images_under_yoco_truncation_equal_the_truncated_stateless_forward(vision_checkpoint, monkeypatch):
    """YoCo prefill truncation acts after the embedding: a request with images decodes as the stateless
    forward truncated at the same KEEP, the prompt length fixed at the expanded prompt's (chunks of 6
    tokens cut the image block)."""
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "mask")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "14")
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    with LLM(model=str(vision_checkpoint), block_size=4, max_num_batched_tokens=6) as llm:
        assert llm.engine.truncation.enabled
        outs = llm.generate(
            [
                # 40 text tokens, the image, 2 more: truncation hides the start from the consumer layers
                {
                    "prompt_token_ids": [0, *range(10, 50), 258, 67, 68],
                    "multi_modal_data": {"image": [png(11)]},
                },
                {"prompt_token_ids": [0, 67, 68]},
            ],
            GREEDY,
            use_tqdm=False,
        )
        model, backtracking = llm.engine.model, llm.engine.truncation.backtracking
    prompt = list(outs[0].prompt_token_ids)
    p = prepare_image(png(11), model.vision.config)
    feats = [model.vision.embed_image(torch.from_numpy(p.patches), p.patch_rows, p.patch_cols)]

    def greedy(**yoco) -> list[int]:
        ids, out = list(prompt), []
        for _ in range(4):
            out.append(int(torch.argmax(model.forward(ids, image_features=feats, **yoco).logits[-1])))
            ids.append(out[-1])
        return out

    want = greedy(
        yoco_keep_tokens=14, yoco_mode="mask", yoco_prompt_len=len(prompt), backtracking_tokens=backtracking
    )
    assert outs[0].error is None and outs[0].outputs[0].token_ids == want
    truncated = model.forward(
        prompt, image_features=feats, yoco_keep_tokens=14, yoco_mode="mask", yoco_prompt_len=len(prompt),
        backtracking_tokens=backtracking,
    ).logits[-1]  # fmt: skip
    assert not torch.equal(truncated, model.forward(prompt, image_features=feats).logits[-1])  # it is real
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4


def test_every_dict_prompt_form_takes_images(llm):
    """The text form, the token form (one placeholder id per image) and both keys together run the same
    expanded prompt; a single dict is one prompt."""
    engine, a = llm.engine, png(12)
    placeholder = engine.images.placeholder_id
    assert placeholder == engine.vocab_size + 2
    ids = engine.encode("a") + [placeholder] + engine.tokenizer.encode("b", add_special_tokens=False).ids
    mm = {"image": [a]}
    forms = [
        _request("a<image>b", a),
        {"prompt_token_ids": ids, "multi_modal_data": mm},
        {"prompt": "label", "prompt_token_ids": tuple(ids), "multi_modal_data": mm},
    ]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    single = llm.generate({"prompt_token_ids": ids, "multi_modal_data": mm}, GREEDY, use_tqdm=False)
    want = _reference(llm, ["a", "b"], [a])
    assert len(single) == 1 and single[0].outputs[0].token_ids == want
    assert [o.outputs[0].token_ids for o in outs] == [want] * 3
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == outs[2].prompt_token_ids
    assert outs[2].prompt == "label"


def test_token_prompt_image_errors(llm):
    engine, a = llm.engine, png(13)
    vocab, placeholder = engine.vocab_size, engine.images.placeholder_id
    batch = [
        {"prompt_token_ids": [0, placeholder, 67, placeholder], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": [0, 67], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": [0, vocab, placeholder], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": [0, placeholder], "multi_modal_data": {"video": [a]}},
        {"prompt_token_ids": [0, placeholder], "multi_modal_data": {"image": [a]}},
    ]
    outs = llm.generate(batch, GREEDY, use_tqdm=False, raise_on_error=False)
    assert "has 1 images but prompt_token_ids has 2 image placeholder ids" in outs[0].error
    assert "has 1 images but prompt_token_ids has 0 image placeholder ids" in outs[1].error
    assert outs[2].error == (
        f"prompt_token_ids[1]={vocab}: must be in [0, {vocab}) (or {placeholder}, the image placeholder id)"
    )
    assert "multi_modal_data: unknown modalities ['video']" in outs[3].error
    assert outs[4].error is None and len(outs[4].outputs[0].token_ids) == 4


def test_image_errors_raise_by_default(llm):
    """As every invalid request: a ValueError naming the request, nothing of the call left running."""
    with pytest.raises(ValueError, match=r"request 1: multi_modal_data\['image'\]\[0\]: cannot decode"):
        llm.generate([_request("a<image>b", png(14)), _request("a<image>b", b"junk")], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    bad = [{"role": "user", "content": [{"type": "video", "video": "x"}]}]
    with pytest.raises(ValueError, match=r"request 0: conversation 0\[0\]\.content\[0\]: a content part"):
        llm.chat(bad, GREEDY, use_tqdm=False)


def test_prompt_logprobs_with_images_score_the_text_positions(llm):
    """Every prompt position but the image block's sentinels (no vocabulary token) gets the logprob of its
    token under the stateless forward with the same image, across prefill chunks that cut the block."""
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    outs = llm.generate(
        [
            {"prompt_token_ids": [0, 5, 6, 258, 67, 68, 69], "multi_modal_data": {"image": [png(15)]}},
            {"prompt_token_ids": [0, 67, 68]},
        ],
        params,
        use_tqdm=False,
    )
    assert [o.error for o in outs] == [None, None]
    ids, got = outs[0].prompt_token_ids, outs[0].prompt_logprobs
    model, vocab = llm.engine.model, llm.engine.vocab_size
    p = prepare_image(png(15), model.vision.config)
    feats = [model.vision.embed_image(torch.from_numpy(p.patches), p.patch_rows, p.patch_cols)]
    want = torch.log_softmax(model.forward(ids, image_features=feats).logits.double(), dim=-1)
    scored = [pos for pos in range(1, len(ids)) if ids[pos] < vocab]
    assert got[0] is None and all(got[pos] is None for pos in range(1, len(ids)) if ids[pos] >= vocab)
    assert len(scored) >= 3 and any(ids[pos] >= vocab for pos in range(len(ids)))
    for pos in scored:
        entry = got[pos]
        assert len(entry) in (2, 3) and ids[pos] in entry
        assert entry[ids[pos]].logprob == pytest.approx(float(want[pos - 1, ids[pos]]), abs=1e-5)
        top = torch.topk(want[pos - 1], 2).indices.tolist()
        assert {t: lp.rank for t, lp in entry.items() if lp.rank <= 2} == {top[0]: 1, top[1]: 2}


def test_encoder_cache_size_setting(vision_checkpoint, monkeypatch):
    """`encoder_cache_tokens` bounds the encoder cache (least recently used image first); the environment
    gives the default, the field and the CLI flag override it, and a bad value names itself."""
    from deepinfer.cli.parser import build_parser
    from deepinfer_model.models.deepseek_v41.vision import prepare_image

    a, b = png(16), png(17)
    monkeypatch.setenv("DEEPINFER_ENCODER_CACHE_TOKENS", "12345")
    assert EngineArgs(model=str(vision_checkpoint)).encoder_cache_tokens == 12345
    argv = ["generate", "--prompt", "x", "--encoder-cache-tokens", "7"]
    assert EngineArgs.from_cli_args(build_parser().parse_args(argv)).encoder_cache_tokens == 7
    with pytest.raises(ValueError, match="encoder_cache_tokens must be an integer >= 1, got 0"):
        EngineArgs(model=str(vision_checkpoint), encoder_cache_tokens=0)
    monkeypatch.setenv("DEEPINFER_ENCODER_CACHE_TOKENS", "0")
    with pytest.raises(ValueError, match="DEEPINFER_ENCODER_CACHE_TOKENS must be"):
        EngineArgs(model=str(vision_checkpoint))
    monkeypatch.delenv("DEEPINFER_ENCODER_CACHE_TOKENS")

    def encodes(tokens: int | None) -> tuple[int, int, list, object]:
        """(misses, hits, outputs, vision config) of the requests a, b, a on a fresh engine."""
        with LLM(model=str(vision_checkpoint), block_size=4, encoder_cache_tokens=tokens) as llm:
            outs = [llm.generate([_request("a<image>b", x)], GREEDY, use_tqdm=False)[0] for x in (a, b, a)]
            cache = llm.engine.images.encoder_cache
            return (
                cache.misses,
                cache.hits,
                [o.outputs[0].token_ids for o in outs],
                llm.engine.model.vision.config,
            )

    misses, hits, _, vcfg = encodes(None)
    assert (misses, hits) == (2, 1)
    one = prepare_image(a, vcfg)
    rows = one.rows * one.cols  # one image's embedding rows: room for a or b, not both
    misses, hits, tokens, _ = encodes(rows)
    assert (misses, hits) == (3, 0) and tokens[0] == tokens[2]  # a encoded again, same embeddings
    assert encodes(2 * rows)[:2] == (2, 1)


def test_a_waiting_request_with_images_is_not_withdrawn(llm):
    """A data-parallel move takes back waiting requests to send them elsewhere; one with images stays (its
    expanded prompt is nothing without them), a text one of the same state goes."""
    engine = llm.engine
    engine.add_request("img", "a<image>b", GREEDY, multi_modal_data={"image": [png(21)]})
    engine.add_request("txt", None, GREEDY, prompt_token_ids=[0, 67, 68])
    assert engine.withdraw_request("img") is None and "img" in engine.requests
    assert engine.withdraw_request("txt") is not None and "txt" not in engine.requests
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert set(outs) == {"img"} and outs["img"].error is None


def test_image_tokens_counts_the_expanded_positions_but_the_padding(llm):
    """A data-parallel front weighs a request with images by `image_tokens` before any rank expands it."""
    from deepinfer.engine.images import ImagePreparer, image_tokens

    mm = {"image": [png(0), png(1, (84, 42))]}
    (out,) = llm.generate(
        [{"prompt_token_ids": [0, 258, 5, 258, 6], "multi_modal_data": mm}], GREEDY, use_tqdm=False
    )
    expanded = len(out.prompt_token_ids) - 3  # the 3 text tokens
    front = ImagePreparer(llm.engine.model.vision.config)  # (no encoder cache: every image preprocessed)
    counted = image_tokens(front.prepare(mm))
    front.close()
    stride = compression_stride(llm.engine.model.config.compress_ratios)
    assert counted <= expanded <= counted + 2 * (stride - 1) and counted > 0
