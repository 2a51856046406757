"""What one engine step hands the model worker, and what it gets back.

The engine builds a step's input from the scheduler's output on its own thread; the worker (inline,
or on the model thread of the asynchronous loop) runs it and returns a result. Nothing else crosses
between the two threads, so neither side holds the other's state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from deepinfer_model import RowParams, StepBatch, TokenBitmask

from .prompt_logprobs import PromptRows, PromptTargets
from .spec_decode import VerifyInput, VerifyOutcome

# Packed masks of the tokens the constrained sequences may produce (structured output), or a
# callable returning them: a mask fill that runs beside the forward, resolved after it.
Allowed = TokenBitmask | Callable[[], TokenBitmask | None] | None


@dataclass
class StepInput:
    """A step that samples at most one token per sequence (prefill chunks and plain decode)."""

    batch: StepBatch
    rows: list[RowParams | None]  # how sequence i samples (None: it emits nothing this step)
    golden: list[int | None]  # teacher forcing: the token sequence i emits instead of its draw
    allowed: Allowed = None  # addressed by sequence index
    # Asynchronous loop: sequence i's row in the step launched before this one, whose sampled token
    # fills i's unknown (-1) input id (None: every input id is known).
    prev_rows: np.ndarray | None = None
    is_prompt: bool = False  # a prefill chunk is in the step (data-parallel EPLB counts those apart)
    prompt_targets: dict[int, PromptTargets] = field(default_factory=dict)  # prompt logprobs to score


@dataclass
class VerifyStepInput:
    """A step whose decode rows verify drafts (speculative decoding; `spec_decode.py`)."""

    batch: StepBatch  # logits_lens = 1 + k for a sequence verifying k drafts
    inputs: list[VerifyInput | None]  # per sequence; None when it emits nothing this step
    allowed: TokenBitmask | None = None  # addressed by row among the emitting sequences' rows, in order
    is_prompt: bool = False
    prompt_targets: dict[int, PromptTargets] = field(default_factory=dict)


@dataclass
class StepResult:
    # One entry per sequence of the batch: the sampled token (or -1 when it emits none / failed).
    tokens: np.ndarray
    logprobs: list[float | None]
    top: list[dict[int, float] | None]
    ranks: list[int | None] = field(default_factory=list)  # 1 + tokens more likely than the emitted one
    errors: dict[int, str] = field(default_factory=dict)  # batch index -> message (request failed alone)
    prompt_rows: dict[int, PromptRows] = field(default_factory=dict)  # batch index -> its scored prompt
    forward_s: float = 0.0
    sample_s: float = 0.0


@dataclass
class VerifyStepResult:
    """A step with drafts: `outcome` covers the batch indices `verified` (in that order)."""

    verified: list[int]
    outcome: VerifyOutcome | None
    errors: dict[int, str] = field(default_factory=dict)
    prompt_rows: dict[int, PromptRows] = field(default_factory=dict)
    forward_s: float = 0.0
    sample_s: float = 0.0
