"""Incremental detokenization with the real DeepSeek-V4 tokenizer; stop strings cut exactly."""

import pytest
from deepinfer.detokenizer import IncrementalDetokenizer, find_stop
from deepinfer.tokenizer import bundled_tokenizer_dir, load_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "混合文本：中文、日本語のテキスト、한국어 and English 🙂🚀👩‍👩‍👧 done.",
    "emoji at the end 🎉",
    "  leading spaces\n\ttabs and newlines\n\n",
    "Ünïcödé façade naïve — “quotes” … ½ ∑ ∞",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(bundled_tokenizer_dir())


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(t) for t in ids]
    detok.flush()
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_split_over_byte_tokens(tok):
    # force the byte-level fallback: one token per UTF-8 byte of a 4-byte emoji and a 3-byte CJK char
    byte_ids = []
    for b in "🙂中".encode():
        byte_ids.append(tok.token_to_id(_byte_token(b)))
    assert None not in byte_ids and len(byte_ids) == 7
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(t) for t in byte_ids]
    assert deltas == ["", "", "", "🙂", "", "", "中"]


def test_special_tokens_skipped_or_kept(tok):
    ids = [0] + tok.encode("Hi there", add_special_tokens=False).ids + [1]
    skip = IncrementalDetokenizer(tok, skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    for t in ids:
        skip.add(t)
        keep.add(t)
    assert skip.text == "Hi there"
    assert keep.text == "<｜begin▁of▁sentence｜>Hi there<｜end▁of▁sentence｜>"


def test_incomplete_character_flushed_at_end(tok):
    ids = [tok.token_to_id(_byte_token(b)) for b in "🙂".encode()[:2]]
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(t) for t in ids] == ["", ""]
    assert detok.flush() == "\ufffd"


def test_find_stop_earliest_and_only_in_new_tail():
    assert find_stop("abc STOP def", 12, ["STOP", "def"]) == (4, "STOP")
    assert find_stop("abcSTO", 2, ["STOP"]) is None
    # the stop string straddles the old text and the new delta
    assert find_stop("abcSTOP", 2, ["STOP"]) == (3, "STOP")
    # old text is not searched again
    assert find_stop("STOP and more", 4, ["STOP"]) is None


def _byte_token(b: int) -> str:
    # GPT-2 style byte-to-unicode table used by byte-level BPE
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    if b in printable:
        return chr(b)
    extra = [x for x in range(256) if x not in printable]
    return chr(256 + extra.index(b))
