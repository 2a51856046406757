"""Answer extraction from model responses, one rule set per benchmark.

All rules look only at the final answer: reasoning is cut at the last ``</think>``. A response
that opens ``<think>`` and never closes it was cut off mid-reasoning and has no final answer.
"""

from __future__ import annotations

import re

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def final_part(response: str | None) -> str:
    """The text after the last ``</think>``; '' for a missing or unfinished response."""
    if not response:
        return ""
    cut = response.rfind(THINK_CLOSE)
    if cut >= 0:
        return response[cut + len(THINK_CLOSE) :]
    if THINK_OPEN in response:  # reasoning never finished: nothing final to grade
        return ""
    return response


# ---------------------------------------------------------------------------------------------
# AIME: math-verify does the extraction and the equivalence (imported lazily: it loads sympy).

_TEXT_DIGITS = re.compile(r"\\text\{\s*(\d+)\s*\}")


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
AIME_BOXED_MODES = ("last", "all")


def boxed_contents(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` (or ``\\fbox{...}``) that closes, braces matched, in order."""
    out = []
    for m in _BOXED.finditer(text):
        depth = 1
        for i in range(m.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                out.append(text[m.end() : i])
                break
    return out


def last_boxed(text: str) -> str | None:
    """The content of the last box; None if none closes.

    The reference convention of math answer grading (the MATH harness's ``last_boxed_only_string``):
    a response with several boxes is graded on its last one, so ``\\boxed{99} or \\boxed{100}`` is
    ``100``, never the two read together."""
    boxes = boxed_contents(text)
    return boxes[-1] if boxes else None


class HedgedBoxes(str):
    """Several boxes holding different values (``aime_extract(..., boxed="all")``): never correct."""


def aime_extract(response: str | None, boxed: str = "last"):
    """math-verify's parse of the final answer: [value, matched string] or [] when none.

    boxed="last" (default, the reference convention): when the final part has a box, only the last
    box is parsed. boxed="all": every box is parsed on its own; boxes that agree give their value,
    boxes that differ give ``[HedgedBoxes("{12, 13}"), ...]``, which scores as wrong (a hedge)."""
    from math_verify import parse, verify

    if boxed not in AIME_BOXED_MODES:
        raise ValueError(f"boxed must be one of {AIME_BOXED_MODES}, got {boxed!r}")
    text = final_part(response)
    if not text.strip():
        return []
    boxes = boxed_contents(text)
    if boxed == "all" and len(boxes) > 1:
        parsed = [parse(_TEXT_DIGITS.sub(r"\1", f"\\boxed{{{c}}}")) for c in boxes]
        if all(p and parsed[0] and verify(parsed[0], p) for p in parsed[1:]):
            return parsed[0]
        hedge = "{" + ", ".join(c.strip() for c in boxes) + "}"
        return [HedgedBoxes(hedge), hedge]
    if boxes:
        text = f"\\boxed{{{boxes[-1]}}}"
    # \text{042} would otherwise parse as a symbol named "042"
    text = _TEXT_DIGITS.sub(r"\1", text)
    return parse(text)


def aime_gold(answer: str):
    from math_verify import parse

    return parse(f"${answer.strip()}$")


def aime_score(response: str | None, answer: str, boxed: str = "last") -> tuple[bool, str | None]:
    """(correct, extracted); `boxed` as in `aime_extract`."""
    from math_verify import verify

    extracted = aime_extract(response, boxed)
    if not extracted:
        return False, None
    if isinstance(extracted[0], HedgedBoxes):
        return False, str(extracted[0])
    return bool(verify(aime_gold(answer), extracted)), str(extracted[0])


# ---------------------------------------------------------------------------------------------
# GPQA: the answer-line convention of openai/simple-evals ("Answer: $LETTER" as the last line).

# Markup that hides an answer line from a plain regex (bold, inline math, boxes, text wrappers).
_GPQA_MARKUP = re.compile(r"\*\*|__|\\boxed\{|\\text(?:bf)?\{|\\mathrm\{|\\mathbf\{|\\\(|\\\)|\$|[{}]")
_GPQA_LINE = re.compile(
    r"answer[ \t]*:[ \t]*\(?([A-Da-d])\)?(?![A-Za-z0-9])(.*)$", re.IGNORECASE | re.MULTILINE
)


def gpqa_extract(response: str | None, ignore_case: bool = False) -> str | None:
    """The letter of the last answer line as written (upper-cased with `ignore_case`), or None.

    A lower-case letter only counts when nothing but punctuation follows it on the line, so
    "Answer: a mix of both" is not read as option A.
    """
    text = _GPQA_MARKUP.sub("", final_part(response))
    letter = None
    for m in _GPQA_LINE.finditer(text):
        if m.group(1).islower() and re.search(r"[A-Za-z0-9]", m.group(2)):
            continue
        letter = m.group(1).upper() if ignore_case else m.group(1)
    return letter


def gpqa_score(response: str | None, answer: str, ignore_case: bool = False) -> tuple[bool, str | None]:
    """simple-evals compares the extracted letter with the gold one as strings: `Answer: c` is not
    `C`. `ignore_case=True` is the lenient mode that upper-cases both."""
    extracted = gpqa_extract(response, ignore_case)
    gold = answer.strip().upper() if ignore_case else answer.strip()
    return extracted is not None and extracted == gold, extracted


# ---------------------------------------------------------------------------------------------
# HLE: the "Answer:" / "Confidence:" lines of the response format we prompt with.

_HLE_ANSWER = re.compile(r"^[ \t>*_#-]*(?:exact[ \t]+|final[ \t]+)?answer[ \t*_]*:[ \t]*(.*)$", re.I | re.M)
_HLE_CONFIDENCE = re.compile(r"^[ \t>*_#-]*confidence[ \t*_]*:[ \t*_]*(\d+(?:\.\d+)?)[ \t]*%?", re.I | re.M)


def hle_extract(response: str | None) -> str | None:
    """The text of the last answer line of the final part, without markdown emphasis."""
    matches = _HLE_ANSWER.findall(final_part(response))
    if not matches:
        return None
    value = matches[-1].strip().strip("*_").strip()
    return value or None


def hle_confidence(response: str | None) -> float | None:
    """The stated confidence as a fraction in [0, 1], or None when the response states none."""
    matches = _HLE_CONFIDENCE.findall(final_part(response))
    if not matches:
        return None
    return min(max(float(matches[-1]) / 100.0, 0.0), 1.0)


def normalize_exact(text: str) -> str:
    """Case, spacing, surrounding $...$ and a final period do not change an exact answer."""
    t = text.strip().rstrip(".").strip()
    if len(t) >= 2 and t.startswith("$") and t.endswith("$"):
        t = t.strip("$").strip().rstrip(".").strip()
    return " ".join(t.casefold().split())


_HEDGE = re.compile(r"^\(?[A-Z]\)?\s*(?:,|/|&|;|\b(?i:or|and)\b)\s*\(?[A-Z]\)?(?:[).:,;/&\s]|$)")


def is_hedged_choice(text: str) -> bool:
    """An answer naming several option letters ("B or C", "B, C", "(B)/(C)", "B and C"): HLE's judge
    criteria count it wrong whatever the gold option is."""
    return bool(_HEDGE.match(text.strip()))


def multiple_choice_letter(text: str) -> str | None:
    """The option letter an answer starts with: "B", "(B)", "B. 42", "b)"."""
    m = re.match(r"^\(?([A-Za-z])(?:[).:]|\s|$)", text.strip())
    return m.group(1).upper() if m else None
