"""The model of one optimizer step: stored values made once per step and shared by its micro-steps.

`TrainableV41.model()` quantises every master again for each micro-step, each value carrying its own
straight-through graph back to its master. Here the trained tensors' stored values are computed once per
optimizer step (`refresh`, in grouped ops: `stored_values`) and held as leaf tensors; every micro-step's
backward accumulates into the leaves, and `push_grads` hands each leaf's gradient to its master. That is
the straight-through gradient itself (d stored / d master = 1), summed over the micro-steps as before.
Frozen tensors (the backbone while the drafter trains) are quantised once for the whole run.

Routed experts are held as one leaf stack `[E, ...]` per layer and matrix, the layout the forward reads,
so no micro-step stacks or unstacks them; each expert's master gets its slice of the stack's gradient.
The library model object is made once (its Engram hasher too); each step swaps in its weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from deepinfer_model.training import F32, DeepseekV41ForCausalLM, V41Weights

from .stored_values import grouped_stored_values
from .trainable import TrainableV41

_EXPERT = re.compile(r"^(.*\.ffn\.)experts\.(\d+)\.(w[123])\.weight$")


class StepWeights:
    """Leaf stored values of the trained tensors of `tr`, the frozen ones' values, and the model on them."""

    def __init__(
        self,
        tr: TrainableV41,
        trained: Iterable[str],
        act_dtype: torch.dtype,
        with_drafter: bool = False,
        moe_fn=None,
    ):
        self.tr = tr
        chosen = set(trained)
        self.trained = [n for n in tr.layout if n in chosen]
        self.kinds = {n: spec.kind for n, spec in tr.layout.items()}
        self.with_drafter = with_drafter
        frozen = {n: tr.masters[n] for n in tr.layout if n not in chosen}
        self.frozen = grouped_stored_values(frozen, self.kinds, tr.block)  # frozen masters never change
        self.leaves: dict[str, torch.Tensor] = {}
        self.stacks: dict[tuple[str, str], torch.Tensor] = {}  # (ffn prefix, w1/w3/w2) -> leaf [E, ...]
        self.weights: V41Weights | None = None
        self._versions: list[int] = []
        self.refresh()
        self.model = DeepseekV41ForCausalLM(
            tr.cfg, self.weights, tr.vocab, act_dtype=act_dtype, moe_fn=moe_fn
        )

    @torch.no_grad()
    def refresh(self) -> None:
        """Start an optimizer step: read the masters again where they changed (in place: an optimizer step,
        the bias update) into new leaves, else keep the leaves; either way with no gradient yet."""
        masters = self.tr.masters
        versions = [masters[n]._version for n in self.trained]
        if self.weights is not None and versions == self._versions:
            for name, leaf in self.leaves.items():
                if leaf is not masters[name]:
                    leaf.grad = None
            for stack in self.stacks.values():
                stack.grad = None
            return
        self._versions = versions
        quantised = {n: masters[n] for n in self.trained if self.kinds[n] != F32}
        values = grouped_stored_values(quantised, self.kinds, self.tr.block)
        experts: dict[tuple[str, str], dict[int, str]] = {}
        for name in values:
            m = _EXPERT.match(name)
            if m:
                experts.setdefault((m[1], m[3]), {})[int(m[2])] = name
        self.stacks, self.leaves, expert_of = {}, {}, {}
        for key, by_id in experts.items():
            names = [by_id[e] for e in sorted(by_id)]
            self.stacks[key] = torch.stack([values[n] for n in names]).requires_grad_()
            expert_of.update((n, (key, e)) for e, n in enumerate(names))
        for name in self.trained:
            if name in expert_of:
                continue
            # FP32 masters are used as they are (the master is its own leaf); the others' values are leaves
            # (detached: a view of the group's tensor would be converted through its base, off the graph)
            self.leaves[name] = (
                masters[name] if self.kinds[name] == F32 else values[name].detach().requires_grad_()
            )
        self._expert_of = expert_of

        def get(name: str) -> torch.Tensor:
            if name in expert_of:
                key, e = expert_of[name]
                return self.stacks[key][e]
            return self.leaves[name] if name in self.leaves else self.frozen[name]

        w = V41Weights.from_tensors(self.tr.cfg, get)
        for prefix, blk in self._blocks(w):
            # the leaf stacks themselves, not the copies `from_tensors` made
            if (prefix, "w1") in self.stacks:
                ex = blk.moe.experts
                ex.w1, ex.w3, ex.w2 = (self.stacks[(prefix, k)] for k in ("w1", "w3", "w2"))
        if not self.with_drafter:
            w.drafter = None
        self.weights = w
        if hasattr(self, "model"):
            self.model.weights = w

    def _blocks(self, w: V41Weights):
        for i, blk in enumerate(w.layers):
            yield f"layers.{i}.ffn.", blk
        if w.drafter is not None:
            for i, blk in enumerate(w.drafter.blocks):
                yield f"mtp.{i}.ffn.", blk

    def push_grads(self) -> None:
        """Add each leaf's accumulated gradient to its master's (as a view of it where the master has none;
        nothing where the leaf got none), as the straight-through graph's backward would have."""
        masters = self.tr.masters
        for name, leaf in self.leaves.items():
            if leaf is not masters[name]:
                _add_grad(masters[name], leaf.grad)
        for name, (key, e) in self._expert_of.items():
            g = self.stacks[key].grad
            _add_grad(masters[name], None if g is None else g[e])


def _add_grad(master: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is None:
        return
    if master.grad is None:
        master.grad = grad
    else:
        master.grad += grad
