"""Answer extraction and equivalence on tricky responses, one rule set per benchmark."""

import pytest
from deepinfer_eval import ExactMatchJudge, JudgeItem, aime_score, final_part, gpqa_extract, hle_confidence
from deepinfer_eval.extract import gpqa_score, last_boxed

# (response, gold, correct, extracted)
AIME_CASES = [
    (r"<think>maybe 41</think>The answer is \boxed{042}.", "42", True, "42"),  # leading zero in response
    (r"\boxed{42}", "042", True, "42"),  # leading zero in gold
    (r"\boxed{24}", "042", False, "24"),
    (r"\boxed{000}", "0", True, "0"),
    (r"\boxed{\text{042}}", "42", True, "42"),
    (r"So the answer is \boxed{3, 5}", "35", False, "{3, 5}"),  # a comma separates values
    (r"The total is 1,234, so modulo 1000 it is \boxed{234}", "234", True, "234"),  # comma outside the box
    (r"\boxed{12} or maybe \boxed{13}", "13", True, "13"),  # several boxes: the last one counts
    (r"\boxed{99} or \boxed{100}", "100", True, "100"),  # never the two read as 99,100
    (r"\boxed{99} or \boxed{100}", "99", False, "100"),
    (r"\boxed{13}. Checking again: \boxed{13}", "13", True, "13"),  # repeated box, one value
    (r"<think>it is \boxed{42}</think>", "42", False, None),  # answer only inside the reasoning
    (r"<think>it is \boxed{42}", "42", False, None),  # reasoning never finished
    (r"<think>\boxed{41}</think>Final: \boxed{42}", "42", True, "42"),  # reasoning cut at last </think>
    (r"<think>a</think><think>\boxed{42}</think>\boxed{7}", "7", True, "7"),  # the LAST </think>
    ("**Final answer: 42**", "42", True, "42"),  # markdown emphasis
    (r"The answer is $\boxed{7}$, since 2+2=4.", "7", True, "7"),  # boxed beats a later number
    ("I could not solve it.", "42", False, None),  # no answer at all
    ("", "42", False, None),
    (None, "42", False, None),  # missing response
]


@pytest.mark.parametrize(("response", "gold", "correct", "extracted"), AIME_CASES)
def test_aime_extraction_and_equivalence(response, gold, correct, extracted):
    assert aime_score(response, gold) == (correct, extracted)


# boxed="all": every box on its own; distinct values are a hedge and score as wrong
AIME_ALL_BOXES_CASES = [
    (r"\boxed{12} or maybe \boxed{13}", "13", False, "{12, 13}"),
    (r"\boxed{99} or \boxed{100}", "100", False, "{99, 100}"),
    (r"\boxed{13}. Checking again: \boxed{13}", "13", True, "13"),
    (r"\boxed{042} and again \boxed{42}", "42", True, "42"),  # one value, written two ways
    (r"So the answer is \boxed{3, 5}", "35", False, "{3, 5}"),
    (r"\boxed{7}", "7", True, "7"),
]


@pytest.mark.parametrize(("response", "gold", "correct", "extracted"), AIME_ALL_BOXES_CASES)
def test_aime_all_boxes_mode(response, gold, correct, extracted):
    assert aime_score(response, gold, boxed="all") == (correct, extracted)


def test_last_boxed_matches_braces():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\fbox{5}") == "5"
    assert last_boxed("no box") is None
    with pytest.raises(ValueError, match="boxed must be one of"):
        aime_score(r"\boxed{1}", "1", boxed="first")


GPQA_CASES = [
    ("Step by step...\nAnswer: B", "B"),
    ("**Answer:** C", "C"),  # markdown emphasis
    ("Final Answer: **B**", "B"),
    ("answer: d", "D"),  # lower-case letter
    ("answer: c.", "C"),
    ("Answer: a mix of both effects", None),  # the article "a", not option A
    ("Answer: $\\boxed{A}$", "A"),
    ("Answer: \\(C\\)", "C"),
    ("Answer: (B)", "B"),
    ("Answer:B", "B"),
    ("ANSWER: B", "B"),
    ("Answer: A\nOn reflection...\nAnswer: D", "D"),  # the last answer line counts
    ("<think>Answer: A</think>\nAnswer: C", "C"),
    ("<think>Answer: A</think>\nI am not sure.", None),  # only inside the reasoning
    ("<think>Answer: A", None),
    ("The answer is B.", None),  # no answer line
    ("", None),
    (None, None),
]


@pytest.mark.parametrize(("response", "letter"), GPQA_CASES)
def test_gpqa_answer_line(response, letter):
    assert gpqa_extract(response, ignore_case=True) == letter
    # by default the letter comes back as written, as simple-evals extracts it
    as_written = gpqa_extract(response)
    assert as_written == letter or (letter is not None and as_written == letter.lower())
    assert (as_written == letter) == (
        response is None or letter is None or f": {letter.lower()}" not in response
    )


def test_gpqa_letter_compared_case_sensitively_by_default():
    assert gpqa_score("answer: c", "C") == (False, "c")
    assert gpqa_score("Answer: C", "C") == (True, "C")
    assert gpqa_score("answer: c", "C", ignore_case=True) == (True, "C")


HLE_CASES = [
    ("Explanation: x\nExact Answer: 7\nConfidence: 80%", "7", "exactMatch", True, "7", 0.8),
    ("**Exact Answer:** $\\pi$.\n**Confidence:** 35%", "\\pi", "exactMatch", True, "$\\pi$.", 0.35),
    ("Exact Answer: Paris France", "paris   france", "exactMatch", True, "Paris France", None),
    ("Exact Answer: 70", "7", "exactMatch", False, "70", None),
    ("Explanation: y\nAnswer: (c)\nConfidence: 101", "C", "multipleChoice", True, "C", 1.0),  # clipped
    ("Answer: B. because of symmetry", "B", "multipleChoice", True, "B", None),
    ("Answer: D", "B", "multipleChoice", False, "D", None),
    ("Answer: B or C", "B", "multipleChoice", False, "B or C", None),  # a hedge names several options
    ("Answer: (B)/(C)", "C", "multipleChoice", False, "(B)/(C)", None),
    ("Answer: B, C\nConfidence: 50%", "B", "multipleChoice", False, "B, C", 0.5),
    ("Answer: B) cats and dogs", "B", "multipleChoice", True, "B", None),  # option text, not a hedge
    ("<think>Exact Answer: 7</think>", "7", "exactMatch", False, None, None),
    ("I do not know.", "7", "exactMatch", False, None, None),
]


@pytest.mark.parametrize(("response", "gold", "kind", "correct", "extracted", "confidence"), HLE_CASES)
def test_hle_exact_match_judge(response, gold, kind, correct, extracted, confidence):
    (verdict,) = ExactMatchJudge().judge([JudgeItem("q", response, gold, kind)])
    assert (verdict.correct, verdict.extracted, verdict.confidence) == (correct, extracted, confidence)
    assert hle_confidence(response) == confidence


def test_hle_hedged_answers_in_the_lenient_mode():
    item = JudgeItem("q", "Answer: B or C", "B", "multipleChoice")
    (verdict,) = ExactMatchJudge(accept_hedged=True).judge([item])
    assert (verdict.correct, verdict.extracted) == (True, "B")


def test_final_part_cuts_at_last_think_close():
    assert final_part("<think>a</think>b</think>c") == "c"
    assert final_part("plain") == "plain"
    assert final_part("<think>unfinished") == ""
