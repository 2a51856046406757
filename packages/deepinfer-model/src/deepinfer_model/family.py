"""The model step contract: what a model family gives the paged runtime, and the registry that finds it.

The runtime (`runtime/`: pools, step metadata, the runner, CUDA-graph capture) is the same for every
model; everything that depends on the architecture - which pools a block holds, the forward over one
packed step, its graph-safe form and why a step cannot take it, the draft step, per-step extras such as
YOCO truncation - is asked of the model's family. A family registers itself under its config's
`model_type` (`register_family`); the runtime finds it with `family_of(model)` and never imports a model.

Methods with a default here are optional capabilities: the default says the family has none (no
graph-safe step, no drafter, no per-step extras), and the runtime then runs that model eagerly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

_FAMILIES: dict[str, ModelFamily] = {}


class ModelFamily(ABC):
    """One model family's step contract (an instance is registered per `model_type`).

    `meta` is the step, a `runtime.step_view.StepView` (the eager `StepMetadata`, or `StaticDecodeMetadata`
    for the graph-safe step), `cache` the runner's `runtime.pools.PagedKVCache`."""

    model_type: ClassVar[str]
    # the eager forward takes `row_split` (a context-parallel step's rows, `runtime.cp_rows`)
    context_parallel: ClassVar[bool] = False
    # key kind -> device-side index builder of the graph-safe step (`StaticDecodeMetadata.cached`)
    static_index: ClassVar[dict] = {}
    # the family's greedy draft sampler (drafts it can replay from graphs); None without a drafter
    greedy: ClassVar[Any] = None

    # -- every family ---------------------------------------------------------------------------------
    def device(self, model) -> torch.device:
        """Where the model's weights are (the forward allocates there)."""
        return model.device

    @abstractmethod
    def cache_specs(self, model, block_size: int) -> list:
        """The `PoolSpec`s of the pools one step reads and writes, for `block_size` tokens per block."""

    @abstractmethod
    def forward(self, model, meta, cache, extras=None) -> torch.Tensor:
        """The eager forward over one packed step: FP32 logits [len(meta.logits_rows), vocab], writing the
        step's keys into `cache`. `extras`: what `step_extras` built for this step (None when off).
        A family whose models take images also accepts `images=` (the step's image embeddings [n, H] in
        packed row order, `StepBatch.step_image_features`); the runner passes it only to such models."""

    def moe_blocks(self, model, part: str = "backbone") -> list:
        """The blocks whose `.moe` holds the experts of `part` ("backbone" or "drafter"), for EPLB."""
        raise ValueError(f"{self.model_type}: no MoE blocks for part {part!r}")

    # -- per-step extras (YOCO truncation) --------------------------------------------------------------
    def check_extras(self, model, settings, backtracking: int):
        """The validated per-step-extras settings (None: off); ValueError when the model cannot run them."""
        if settings is None or not settings.enabled:
            return None
        raise ValueError(f"yoco truncation needs a model with a YOCO split, not {self.model_type!r}")

    def extras_specs(self, settings, block_size: int) -> list:
        """Pools the per-step extras need on top of `cache_specs` (none when `settings` is None)."""
        return []

    def step_extras(self, model, meta, cache, settings, seq_ids, prompt_lens):
        """The extras of one step (before its forward, which receives them), or ValueError naming the
        sequence when the step cannot run under them. `prompt_lens`: each sequence's original prompt
        length, batch order (the step's `StepBatch.prompt_lens`; None for a hand-built step without them)."""
        raise ValueError(f"{self.model_type} has no per-step extras")

    def resume_problem(self, model, cache, meta, settings, prompt_len: int) -> str | None:
        """Why a one-sequence step `meta` would read cached state computed under other extras (None: safe)."""
        return None

    # -- graph-safe step --------------------------------------------------------------------------------
    def static_problem(self, model) -> str | None:
        """Why `static_forward` cannot run this model (None: it can)."""
        return f"graph-safe decode is not implemented for {self.model_type!r}"

    def static_forward(self, model, meta, cache) -> torch.Tensor:
        """The graph-safe decode / verification step over `StaticDecodeMetadata`: FP32 logits [N, vocab]
        with no host sync and every shape fixed by the metadata (CUDA-graph capturable)."""
        raise NotImplementedError(self.static_problem(model))

    def static_batch_invariant_problem(self, model, drafter: bool = False) -> str | None:
        """Why the graph-safe step (`drafter`: draft) cannot run batch-invariant on the CPU (None: it can)."""
        return None

    # -- drafts -----------------------------------------------------------------------------------------
    def has_drafter(self, model) -> bool:
        return False

    def draft(self, model, meta, cache, seqs, tokens, num_draft_tokens, sampler, last_positions) -> list:
        """One drafted block per listed sequence of the executed step `meta` (eager)."""
        raise ValueError(f"drafting needs a model with draft blocks, not {self.model_type!r}")

    def draft_last_positions(self, model, meta, seqs, tokens, last_positions):
        """The position each listed sequence drafts after (host int64 array), validated with `tokens`."""
        raise ValueError(f"drafting needs a model with draft blocks, not {self.model_type!r}")

    def static_draft_problem(self, model) -> str | None:
        """Why `static_draft` cannot run this model (None: it can)."""
        return f"the graph-safe draft is not implemented for {self.model_type!r}"

    def draft_window(self, model) -> int:
        """Main-key positions one draft row reads (the width of its window slots)."""
        raise NotImplementedError(self.static_draft_problem(model))

    def draft_pools(self, model) -> list[str]:
        """The pools the graph-safe draft reads through window slots (their dummy slot is zeroed)."""
        return []

    def draft_window_slots(self, meta, seqs, last, width: int):
        """Host cache slots [N, width] of each listed sequence's draft window (after position `last`)."""
        raise NotImplementedError

    def draft_temperatures(self, num_draft_tokens: int) -> torch.Tensor:
        """The confidence temperatures the graph-safe draft reads from a device buffer."""
        raise NotImplementedError

    def static_draft(
        self, model, cache, tokens, last, window_slots, num_draft_tokens, temperatures, pick=None
    ):
        """The graph-safe draft -> (tokens, logits, confidence, hidden, positions) [N, k, ...]: greedy, or
        drawn by `pick(logits [N, V], s)` -> [N] (a graph-safe row sampler, `runtime.draft_sampling`)."""
        raise NotImplementedError(self.static_draft_problem(model))

    def draft_output(self, tokens, confidence, positions, probs=None):
        """One drafted block of a graph replay (no logits, no hidden; `probs` q of a sampled row)."""
        raise NotImplementedError


def register_family(family: ModelFamily) -> ModelFamily:
    """Register `family` under its `model_type` (a model module does it when imported)."""
    known = _FAMILIES.get(family.model_type)
    if known is not None and type(known) is not type(family):
        raise ValueError(f"model_type {family.model_type!r} is already registered by {type(known).__name__}")
    _FAMILIES[family.model_type] = family
    return family


def family_for_type(model_type: str) -> ModelFamily:
    if model_type not in _FAMILIES:
        raise ValueError(
            f"no paged model family registered for model_type {model_type!r} (registered: {sorted(_FAMILIES)})"
        )
    return _FAMILIES[model_type]


def family_of(model) -> ModelFamily:
    """The registered family of `model`, by its config's `model_type`."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise ValueError(f"{type(model).__name__} has no config.model_type: no model family to run it")
    return family_for_type(model_type)


def check_context_parallel(family: ModelFamily, yoco_enabled: bool) -> None:
    """ValueError when steps of `family` cannot be split over context-parallel ranks: the family has no
    context-parallel forward, or YOCO prefill truncation is on (its rectangle skips rows the mirror
    split would hand to another rank)."""
    if not family.context_parallel:
        raise ValueError(
            f"context_parallel_size > 1 needs a model family with context-parallel steps (deepseek_v41), "
            f"not {family.model_type!r}"
        )
    if yoco_enabled:
        raise ValueError("context_parallel_size > 1 cannot be combined with YOCO prefill truncation")


def registered_model_types() -> list[str]:
    return sorted(_FAMILIES)
