"""Prompt templates (documented in the README) and GPQA's per-sample option shuffle.

All instructions go into one user message: DeepSeek's reasoning models are meant to be run
without a system prompt.
"""

from __future__ import annotations

import hashlib
import random

AIME_TEMPLATE = (
    "{problem}\n\n"
    "Reason step by step. The answer is an integer from 0 to 999; put the final answer inside \\boxed{{}}."
)

# The answer-line convention of openai/simple-evals: the response ends with "Answer: $LETTER".
GPQA_TEMPLATE = (
    "Answer the multiple-choice question below. Think it through step by step, and make the last line "
    "of your response read 'Answer: $LETTER' (without quotes), where LETTER is one of A, B, C or D.\n\n"
    "{question}\n\nA) {A}\nB) {B}\nC) {C}\nD) {D}"
)

# The response format HLE grades: an explanation, one answer line and a stated confidence.
HLE_TEMPLATE = (
    "{question}\n\n"
    "Write your response in exactly this format:\n"
    "Explanation: {{why your answer is right}}\n"
    "{answer_label}: {{{answer_hint}}}\n"
    "Confidence: {{how sure you are of your answer, from 0% to 100%}}"
)
_HLE_LABELS = {
    "exactMatch": ("Exact Answer", "your final answer, as short as possible"),
    "multipleChoice": ("Answer", "the letter of the option you choose"),
}

LETTERS = "ABCD"


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from the parts, the same in every process (Python's hash() is salted)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def gpqa_shuffle_seed(seed: int, task_id: str, sample: int) -> int:
    return stable_seed("gpqa-shuffle", seed, task_id, sample)


def gpqa_permutation(seed: int, task_id: str, sample: int) -> list[int]:
    """Order of (correct, incorrect 1, incorrect 2, incorrect 3) shown as options A-D:
    ``random.Random(shuffle_seed).sample(range(4), 4)``."""
    return random.Random(gpqa_shuffle_seed(seed, task_id, sample)).sample(range(4), 4)


def gpqa_prompt(task: dict, permutation: list[int]) -> tuple[str, str]:
    """(prompt, gold letter) for one shuffled order."""
    choices = [task["correct"], *task["incorrect"]]
    shown = [choices[i] for i in permutation]
    gold = LETTERS[permutation.index(0)]
    return GPQA_TEMPLATE.format(question=task["question"], **dict(zip(LETTERS, shown))), gold


def aime_prompt(task: dict) -> str:
    return AIME_TEMPLATE.format(problem=task["problem"])


def hle_prompt(task: dict) -> str:
    label, hint = _HLE_LABELS[task["answer_type"]]
    return HLE_TEMPLATE.format(question=task["question"], answer_label=label, answer_hint=hint)
