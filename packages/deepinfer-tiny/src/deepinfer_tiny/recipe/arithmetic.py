"""Seeded synthetic arithmetic in the eval harness's AIME format (an integer answer 0-999 in \\boxed{}).

The prompt is `deepinfer-eval`'s AIME template around the problem, rendered in the engine's chat format,
so `deepinfer-eval generate` / `score` can grade the trained model on held-out problems. A problem goes
to the held-out split by a hash of its text, so no held-out problem is ever trained on.
"""

from __future__ import annotations

import hashlib
import random

from .chat import render_exchange

# deepinfer_eval.prompts.AIME_TEMPLATE (the recipe does not import the eval package; a test compares them)
AIME_TEMPLATE = (
    "{problem}\n\n"
    "Reason step by step. The answer is an integer from 0 to 999; put the final answer inside \\boxed{{}}."
)
GENERATOR = "deepinfer_tiny.recipe.arithmetic v1"


def _one(rng: random.Random) -> tuple[str, str, str]:
    """(problem, worked answer, final answer) with every intermediate and the result in 0..999."""
    while True:
        kind = rng.randrange(4)
        if kind == 0:
            a, b = rng.randrange(1000), rng.randrange(1000)
            if a + b > 999:
                continue
            return f"Compute {a} + {b}.", f"{a} + {b} = {a + b}.", str(a + b)
        if kind == 1:
            a, b = rng.randrange(1000), rng.randrange(1000)
            a, b = max(a, b), min(a, b)
            return f"Compute {a} - {b}.", f"{a} - {b} = {a - b}.", str(a - b)
        if kind == 2:
            a, b = rng.randrange(2, 100), rng.randrange(2, 50)
            if a * b > 999:
                continue
            return f"Compute {a} \\times {b}.", f"{a} \\times {b} = {a * b}.", str(a * b)
        a, b, c = rng.randrange(100), rng.randrange(100), rng.randrange(2, 10)
        if (a + b) * c > 999:
            continue
        s = a + b
        return (
            f"Compute ({a} + {b}) \\times {c}.",
            f"{a} + {b} = {s}. Then {s} \\times {c} = {s * c}.",
            str(s * c),
        )


def is_heldout(problem: str, fraction: float) -> bool:
    digest = hashlib.sha256(problem.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


def problems(seed: int, count: int, heldout: bool, fraction: float) -> list[dict]:
    """`count` distinct problems of one split: `{"id", "problem", "answer", "text"}` (`text`: the rendered
    exchange with the worked answer, what the model trains or is scored on)."""
    rng = random.Random(seed)
    out, seen = [], set()
    tries = 0
    while len(out) < count:
        tries += 1
        if tries > 200 * count + 1000:
            raise ValueError(f"could not draw {count} distinct problems of this split")
        problem, worked, answer = _one(rng)
        if problem in seen or is_heldout(problem, fraction) != heldout:
            continue
        seen.add(problem)
        response = f"{worked}\n\n\\boxed{{{answer}}}"
        text = render_exchange(AIME_TEMPLATE.format(problem=problem), response)
        out.append({"id": f"arith-{len(out)}", "problem": problem, "answer": answer, "text": text})
    return out
