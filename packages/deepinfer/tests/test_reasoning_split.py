"""The thinking-output split (deepinfer/reasoning.py): whole texts, the thinking mode read off the rendered
chat prompt, and the streaming split, whose pieces must add up to the whole split however the text is cut
into deltas (markers split across deltas included)."""

from deepinfer import ReasoningSplit, ReasoningStream, split_reasoning  # the public names
from deepinfer.reasoning import THINK_END, starts_in_reasoning
from deepinfer.tokenizer import render_chat
from deepinfer_model.tokenizer_files import DEFAULT_CHAT_TEMPLATE
from hypothesis import given, settings
from hypothesis import strategies as st

CONFIG = {"chat_template": DEFAULT_CHAT_TEMPLATE, "bos_token": "<｜begin▁of▁sentence｜>"}
MESSAGES = [{"role": "user", "content": "Hi"}]


def test_split_of_whole_texts():
    assert split_reasoning("let me see</think>Blue.") == ReasoningSplit("let me see", "Blue.")
    assert split_reasoning("</think>") == ReasoningSplit("", "")
    # only the first marker ends the reasoning; later ones are the answer's text
    assert split_reasoning("a</think>b</think>c") == ReasoningSplit("a", "b</think>c")
    # cut short inside the reasoning: no answer at all
    assert split_reasoning("still thinking </thi") == ReasoningSplit("still thinking </thi", None)
    assert split_reasoning("") == ReasoningSplit("", None)
    # outside thinking mode the text is all content, markers and all
    assert split_reasoning("a</think>b", in_reasoning=False) == ReasoningSplit(None, "a</think>b")


def test_thinking_mode_is_read_off_the_rendered_prompt():
    def prompt(kwargs):
        return render_chat(MESSAGES, CONFIG, chat_template_kwargs=kwargs)

    assert starts_in_reasoning(prompt({"thinking": True}))
    assert not starts_in_reasoning(prompt({"thinking": False}))
    assert not starts_in_reasoning(prompt(None))
    assert starts_in_reasoning("<｜User｜>Hi<｜Assistant｜><think>\n")  # a template that adds a newline
    assert not starts_in_reasoning("<think>x</think>")


def test_stream_holds_back_a_possible_marker_until_it_is_known():
    s = ReasoningStream()
    assert s.feed("abc</th") == ("abc", "")
    assert s.in_reasoning
    assert s.feed("ink>Blue") == ("", "Blue")
    assert not s.in_reasoning
    assert s.feed(" and <think>") == ("", " and <think>")
    # a held-back start that turns out not to be the marker is reasoning after all
    s = ReasoningStream()
    assert s.feed("x <") == ("x ", "")
    assert s.feed("/b") == ("</b", "")
    assert s.feed("</") == ("", "")
    assert s.finish() == ("</", "")
    # outside thinking mode nothing is held
    s = ReasoningStream(in_reasoning=False)
    assert s.feed("a</") == ("", "a</")
    assert s.finish() == ("", "")


# texts rich in marker pieces, so that splits fall inside markers and near-misses occur
PIECES = st.sampled_from(["a", "b ", "<", "/", "t", "think", ">", "</", "</think>", "<think>", "</thin", "é"])


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(PIECES, max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
    in_reasoning=st.booleans(),
)
def test_stream_pieces_add_up_to_the_whole_split(pieces, cuts, in_reasoning):
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    stream = ReasoningStream(in_reasoning)
    reasoning, content = [], []
    for delta in deltas:
        r, c = stream.feed(delta)
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    reasoning.append(r)
    content.append(c)
    want = split_reasoning(text, in_reasoning)
    assert "".join(reasoning) == (want.reasoning or "")
    assert "".join(content) == (want.content or "")
    # the stream knows the reasoning ended exactly when the whole text has an answer part
    assert stream.in_reasoning == (in_reasoning and THINK_END not in text)
