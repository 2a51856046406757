"""DeepSeek's thinking output split into its reasoning and its answer, whole or as a stream of text deltas.

In thinking mode the chat prompt ends in the think-start marker `<think>`, so a completion begins inside
the reasoning: everything up to the first think-end marker `</think>` is reasoning, everything after it
the answer (`content`). A completion cut short (max_tokens) before the marker is reasoning only, with no
answer. Whether a completion starts in the reasoning is read off its prompt (`starts_in_reasoning`), so
any chat template that opens the reasoning at the end of its generation prompt works, not only the
built-in one; a prompt that does not (non-thinking mode, the plain format) leaves the completion whole.

The markers are ordinary text of the detokenized output (the tokenizer's `<think>` / `</think>` are not
special tokens, and a model may also spell them out piece by piece), so the split works on text. The
streaming split (`ReasoningStream`) holds back the end of a delta that could be the start of a marker
until the next delta tells; concatenating its pieces gives exactly `split_reasoning` of the whole text,
however the text was cut into deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


def starts_in_reasoning(prompt: str) -> bool:
    """Whether a completion of `prompt` begins inside the reasoning: the prompt ends in the think-start
    marker (trailing whitespace aside, which some templates put after it)."""
    return prompt.rstrip().endswith(THINK_START)


@dataclass(frozen=True)
class ReasoningSplit:
    """reasoning: the text before the think-end marker (None when the completion started outside the
    reasoning); content: the text after it, None when the reasoning never ended (cut short)."""

    reasoning: str | None
    content: str | None


def split_reasoning(text: str, in_reasoning: bool = True) -> ReasoningSplit:
    """A whole completion's text split at its first think-end marker; with `in_reasoning` False (the
    prompt did not open a reasoning) the text is all content."""
    if not in_reasoning:
        return ReasoningSplit(None, text)
    end = text.find(THINK_END)
    if end < 0:
        return ReasoningSplit(text, None)
    return ReasoningSplit(text[:end], text[end + len(THINK_END) :])


def _partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker` (0 if none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """The split of one completion, fed its text delta by delta.

    `feed(delta)` returns the (reasoning, content) text that is certain now; `finish()` the rest once the
    completion ended (a held-back partial marker that never completed is reasoning after all).
    `in_reasoning` tells which part the next text belongs to as far as known.
    """

    def __init__(self, in_reasoning: bool = True) -> None:
        self.in_reasoning = in_reasoning
        self._held = ""  # the end of the text so far that may be the start of the think-end marker

    def feed(self, delta: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", delta
        text = self._held + delta
        end = text.find(THINK_END)
        if end >= 0:
            self.in_reasoning, self._held = False, ""
            return text[:end], text[end + len(THINK_END) :]
        hold = _partial_marker_len(text, THINK_END)
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold], ""

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return held, ""
