"""What the model card's sections share: the inputs, the record list, per-token losses of the served model."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

# Logits of this many positions at a time: a 4,096-token window's [T, 129,280] FP32 logits alone are 2 GB.
LOGIT_CHUNK = 256


@dataclass
class Inputs:
    """The command line's inputs, resolved; a section whose input is None is skipped."""

    model: Path | None
    data: Path | None
    logs: list[Path]
    masters: Path | None
    baseline_model: Path | None
    out: Path
    quick: bool
    device: str | None
    counts: dict


@dataclass
class Records:
    """Flat JSON records (one dict per measurement; units in the key names) and skipped sections."""

    rows: list[dict] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def add(self, section: str, **values) -> dict:
        row = {"section": section, **values}
        for key, value in row.items():
            if isinstance(value, dict | list | tuple):
                raise TypeError(f"record field {key!r} of section {section!r} must be a scalar")
        self.rows.append(row)
        return row

    def of(self, section: str) -> list[dict]:
        return [r for r in self.rows if r["section"] == section]

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({"records": self.rows, "skipped": self.skipped}, indent=1) + "\n")


def evenly_spaced_windows(stream: np.ndarray, length: int, count: int) -> list[np.ndarray]:
    """`count` windows of `length` tokens whose starts are spread evenly over `stream` (first and last
    possible start included): the held-out rule of the training recipe's evals."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if stream.size < length:
        raise ValueError(f"the held-out stream ({stream.size} tokens) is shorter than one window ({length})")
    starts = np.linspace(0, stream.size - length, count).astype(np.int64)
    return [np.asarray(stream[s : s + length], dtype=np.int64) for s in starts]


@torch.no_grad()
def token_nll(model, ids: np.ndarray) -> np.ndarray:
    """-log p(ids[t] | ids[:t]) for t = 1 .. len - 1 (float64), from one forward of `model` (a
    `DeepseekV41ForCausalLM`) over `ids`: its final hidden states through the model's own LM-head
    function (`numerics.logits`, what `forward` applies), a chunk of positions at a time."""
    from deepinfer_model.training import numerics

    tokens = torch.as_tensor(ids, dtype=torch.long, device=model.device)
    out = model.forward(tokens, logit_rows=[-1])  # the hidden states of every position; logits below
    hidden = out.hidden[:-1]
    targets = tokens[1:]
    nll = []
    for lo in range(0, hidden.shape[0], LOGIT_CHUNK):
        logits = numerics.logits(hidden[lo : lo + LOGIT_CHUNK], model.weights.head, model.act_dtype)
        logp = torch.log_softmax(logits.double(), dim=-1)
        nll.append(-logp.gather(1, targets[lo : lo + LOGIT_CHUNK, None])[:, 0])
    return torch.cat(nll).cpu().numpy()


def ppl(loss_nats: float) -> float:
    return math.exp(loss_nats)


def read_config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())["text_config"]
