"""MoE dispatch / combine through DeepEP (`deep_ep.EPBuffer`, NVIDIA, NCCL group): the fast EP backend.

Contract, next to `ep.dispatch_combine` (the torch all-to-all backend, always available and the in-run
baseline): the routed-expert output ``sum_k w[t,k] * expert_{ids[t,k]}(hidden[t])`` for this rank's tokens,
collective over the EP group (every member calls it for every MoE layer, also with no tokens).

Differences that matter to a caller:

* rows travel in BF16 (DeepEP's combine input must be BF16) and DeepEP sends a token once per destination
  rank, however many of its experts live there (the torch backend sends one row per choice, in the input
  dtype);
* the expert function gets each row's routing weight and returns the *weighted* output
  (``expert_fn(slot, tokens[n, H], weights[n]) -> [n, H]``): V4.1 scales the SwiGLU output before the down
  projection (v41-model §6.2), the public V4 after it; the combine is then a plain sum;
* at most ``max_tokens_per_rank`` tokens per call (fixed when the buffer is built; every rank must agree);
* DeepEP's combine kernel moves a row in units of ``HIDDEN_ALIGN`` BF16 values (32 lanes x 16 bytes), so a
  hidden size that is not a multiple of it (small test models; real ones are: 4096, 7168) travels
  zero-padded to the next multiple, and the caller sees only its own columns.

The expanded layout (``do_expand=True``) puts the rows of local expert slot ``s`` contiguously, slot after
slot; the CPU-side counts come from the dispatch's receive-count sync (one host sync per call).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .ep import slot_ranges
from .layout import LayerExpertLayout

# expert_fn(local_slot, tokens[n, H] bf16, weights[n] fp32) -> weighted outputs [n, H]
HIDDEN_ALIGN = 32 * 16 // 2  # DeepEP combine: hidden % (32 lanes * sizeof(int4) / sizeof(bf16)) == 0
WeightedExpertFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def deep_ep_available() -> bool:
    """True when `deep_ep` imports and a CUDA device is present (the backend's preconditions)."""
    if not torch.cuda.is_available():
        return False
    try:
        import deep_ep  # noqa: F401
    except Exception:  # ImportError, or its NCCL checks failing at import
        return False
    return True


class DeepEPDispatcher:
    """One `deep_ep.EPBuffer` for an EP group, sized for ``max_tokens_per_rank`` tokens of ``hidden`` BF16
    values with ``top_k`` choices among ``num_physical`` expert slots (``RedundantExpertLayout.num_physical``).
    Build it on every rank of the group (collective); `destroy()` before the process group goes away."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        hidden: int,
        top_k: int,
        num_physical: int,
        max_tokens_per_rank: int,
    ):
        import deep_ep

        for name, value in (
            ("hidden", hidden),
            ("top_k", top_k),
            ("num_physical", num_physical),
            ("max_tokens_per_rank", max_tokens_per_rank),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        size = dist.get_world_size(group)
        if num_physical % size:
            raise ValueError(f"num_physical={num_physical} must be a multiple of the EP group size {size}")
        self.group, self.hidden, self.top_k = group, hidden, top_k
        self.wire_hidden = -(-hidden // HIDDEN_ALIGN) * HIDDEN_ALIGN  # row width on the wire
        self.num_physical, self.max_tokens_per_rank = num_physical, max_tokens_per_rank
        self.ep_rank = dist.get_rank(group)
        self.slots_per_rank = num_physical // size
        self.index_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        self.buffer = deep_ep.EPBuffer(
            group if group is not None else dist.group.WORLD,
            num_max_tokens_per_rank=max_tokens_per_rank,
            hidden=self.wire_hidden,
            num_topk=top_k,
            explicitly_destroy=True,
        )

    def destroy(self) -> None:
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None

    def dispatch(self, hidden: torch.Tensor, physical: torch.Tensor, weights: torch.Tensor):
        """Send each token to the ranks owning its physical expert slots. Returns ``(rows [N, H] bf16,
        row_weights [N] fp32, rows_per_slot: list[int] (local slots, in order), handle)``."""
        self._check(hidden, physical, weights)
        recv_x, _recv_idx, recv_w, handle, _event = self.buffer.dispatch(
            self._to_wire(hidden),
            topk_idx=physical.to(self.index_dtype).contiguous(),
            topk_weights=weights.to(torch.float32).contiguous(),
            num_experts=self.num_physical,
            num_max_tokens_per_rank=self.max_tokens_per_rank,
            expert_alignment=1,
            do_expand=True,
        )
        return recv_x[:, : self.hidden], recv_w, list(handle.num_recv_tokens_per_expert_list), handle

    def combine(self, rows: torch.Tensor, handle, num_tokens: int) -> torch.Tensor:
        """Sum the (already weighted) expert outputs back into each token's own rank: ``[T, H]`` bf16."""
        combined, _weights, _event = self.buffer.combine(self._to_wire(rows), handle)
        return combined[:num_tokens, : self.hidden]

    def _to_wire(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [n, hidden]`` as the contiguous BF16 ``[n, wire_hidden]`` the buffer moves (zero columns
        appended when hidden is not a multiple of HIDDEN_ALIGN)."""
        rows = rows.to(torch.bfloat16)
        if self.wire_hidden != self.hidden:
            return torch.nn.functional.pad(rows, (0, self.wire_hidden - self.hidden))
        return rows.contiguous()

    def dispatch_combine(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        expert_fn: WeightedExpertFn,
        layout: LayerExpertLayout,
        expert_count: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Routed-expert output for this rank's ``hidden [T, H]`` (logical ``topk_ids [T, k]``), in
        ``hidden.dtype``. ``expert_count [slots_per_rank]`` gets the rows each local slot processed added."""
        if layout.num_physical != self.num_physical or layout.slots_per_rank != self.slots_per_rank:
            raise ValueError(
                f"layout has {layout.num_physical} slots ({layout.slots_per_rank} per rank); the DeepEP buffer "
                f"was built for {self.num_physical} ({self.slots_per_rank} per rank)"
            )
        physical = layout.physical_of(topk_ids, self.ep_rank)
        rows, row_weights, per_slot, handle = self.dispatch(hidden, physical, topk_weights)
        out = torch.zeros_like(rows)
        for slot, lo, hi in slot_ranges(per_slot):
            out[lo:hi] = expert_fn(slot, rows[lo:hi], row_weights[lo:hi])
        if expert_count is not None:
            expert_count += torch.tensor(per_slot, dtype=expert_count.dtype, device=expert_count.device)
        return self.combine(out, handle, hidden.shape[0]).to(hidden.dtype)

    def _check(self, hidden: torch.Tensor, physical: torch.Tensor, weights: torch.Tensor) -> None:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden:
            raise ValueError(f"hidden must be [T, {self.hidden}], got {tuple(hidden.shape)}")
        if physical.shape != (hidden.shape[0], self.top_k) or weights.shape != physical.shape:
            raise ValueError(
                f"topk ids and weights must be [T, {self.top_k}] with T={hidden.shape[0]}, got "
                f"{tuple(physical.shape)} and {tuple(weights.shape)}"
            )
        if hidden.shape[0] > self.max_tokens_per_rank:
            raise ValueError(
                f"{hidden.shape[0]} tokens exceed the DeepEP buffer's max_tokens_per_rank="
                f"{self.max_tokens_per_rank} (rebuild it with a larger bound)"
            )
