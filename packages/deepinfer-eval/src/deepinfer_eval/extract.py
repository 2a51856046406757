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


def aime_extract(response: str | None):
    """math-verify's parse of the final part: [value, matched string] or [] when none."""
    from math_verify import parse

    text = final_part(response)
    if not text.strip():
        return []
    # \text{042} would otherwise parse as a symbol named "042"
    text = _TEXT_DIGITS.sub(r"\1", text)
    return parse(text)


def aime_gold(answer: str):
    from math_verify import parse

    return parse(f"${answer.strip()}$")


def aime_score(response: str | None, answer: str) -> tuple[bool, str | None]:
    """(correct, extracted). Several \\boxed{} answers with different values become a set
    (math-verify's rule), which never equals a single integer, so hedging scores as wrong."""
    from math_verify import verify

    extracted = aime_extract(response)
    if not extracted:
        return False, None
    return bool(verify(aime_gold(answer), extracted)), str(extracted[0])


# ---------------------------------------------------------------------------------------------
# GPQA: the answer-line convention of openai/simple-evals ("Answer: $LETTER" as the last line).

# Markup that hides an answer line from a plain regex (bold, inline math, boxes, text wrappers).
_GPQA_MARKUP = re.compile(r"\*\*|__|\\boxed\{|\\text(?:bf)?\{|\\mathrm\{|\\mathbf\{|\\\(|\\\)|\$|[{}]")
_GPQA_LINE = re.compile(
    r"answer[ \t]*:[ \t]*\(?([A-Da-d])\)?(?![A-Za-z0-9])(.*)$", re.IGNORECASE | re.MULTILINE
)


def gpqa_extract(response: str | None) -> str | None:
    """The letter of the last answer line, upper-cased, or None.

    A lower-case letter only counts when nothing but punctuation follows it on the line, so
    "Answer: a mix of both" is not read as option A.
    """
    text = _GPQA_MARKUP.sub("", final_part(response))
    letter = None
    for m in _GPQA_LINE.finditer(text):
        if m.group(1).islower() and re.search(r"[A-Za-z0-9]", m.group(2)):
            continue
        letter = m.group(1).upper()
    return letter


def gpqa_score(response: str | None, answer: str) -> tuple[bool, str | None]:
    extracted = gpqa_extract(response)
    return extracted is not None and extracted == answer.strip().upper(), extracted


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


def multiple_choice_letter(text: str) -> str | None:
    """The option letter an answer starts with: "B", "(B)", "B. 42", "b)"."""
    m = re.match(r"^\(?([A-Za-z])(?:[).:]|\s|$)", text.strip())
    return m.group(1).upper() if m else None
