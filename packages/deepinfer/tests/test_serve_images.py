"""`deepinfer serve`'s chat endpoint with OpenAI `image_url` parts, through the official `openai` client:
the answer equals the offline `LLM.chat` of the same messages; a URL other than `data:` (remote, file://,
a path), an undecodable image or another part type is a 400 naming the field; a text chat still runs."""

import openai
import pytest
from deepinfer import LLM, AsyncLLM, EngineArgs, LLMEngine, SamplingParams
from deepinfer.serve import build_app
from deepinfer.serve.background import BackgroundServer
from image_common import data_url, png

ENGINE = dict(block_size=4, max_num_batched_tokens=6)


@pytest.fixture(scope="module")
def client(vision_checkpoint):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(vision_checkpoint), **ENGINE))
    with BackgroundServer(build_app(AsyncLLM.from_engine(engine), "micro")) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _messages(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def test_chat_with_image_parts_equals_offline(client, vision_checkpoint):
    a, b = png(0), png(1, (42, 70))
    messages = _messages(
        {"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {"url": data_url(a)}},
        {"type": "image_url", "image_url": {"url": data_url(b)}},
        {"type": "text", "text": "b"},
    )
    got = client.chat.completions.create(model="micro", messages=messages, max_tokens=4, temperature=0)
    with LLM(model=str(vision_checkpoint), **ENGINE) as llm:
        want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert want.error is None and sum(t >= llm.engine.vocab_size for t in want.prompt_token_ids) > 0
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids) == 4


def test_bad_image_parts_are_400_naming_the_field(client, tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(png(2))
    for url in ("https://example.com/x.png", f"file://{path}", str(path)):
        part = {"type": "image_url", "image_url": {"url": url}}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="micro", messages=_messages({"type": "text", "text": "a"}, part)
            )
        assert e.value.body["param"] == "messages[0].content[1]"
        assert "the server takes images as data: URLs only" in e.value.body["message"]

    bad_base64 = _messages({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="micro", messages=bad_base64, max_tokens=2)
    assert e.value.body["param"] == "messages[0].content[0]"
    assert "base64 content does not decode" in e.value.body["message"]

    junk = _messages(
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": data_url(b"junk")}}
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="micro", messages=junk, max_tokens=2)
    assert e.value.body["param"] == "messages"
    assert "multi_modal_data['image'][0]: cannot decode the image bytes" in e.value.body["message"]

    video = _messages({"type": "video_url", "video_url": {"url": "x"}})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="micro", messages=video, max_tokens=2)
    assert e.value.body["param"] == "messages[0].content[0]"

    text = client.chat.completions.create(
        model="micro", messages=[{"role": "user", "content": "b"}], max_tokens=3, temperature=0
    )
    assert text.usage.completion_tokens == 3
