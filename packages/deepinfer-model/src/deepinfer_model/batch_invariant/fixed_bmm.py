"""Fixed-shape batched products: a matrix's result does not depend on how many others share its call, nor
a row's on the row count (`tiled_matmul`: fixed tiles of `TILE_ROWS` rows).

Device-agnostic: everything here allocates on the inputs' device and uses only torch ops (bmm, exp,
max) that exist on every backend. The CPU's bmm is one GEMM per matrix (measured: batch-count
independent). cuBLAS chooses its kernel (tile shape, split-K) from the whole problem, batch count
included, so on other devices every bmm call gets exactly `DEVICE_BATCH` matrices (zero-padded, in
chunks): each call then has one shape, one kernel, and a matrix's result does not depend on which
others share its call. That is the reference (`cpu` table) behaviour of the registry ops `tile_bmm` and
`rows_matmul` which `bmm`, `_products` and `device_rows` call off the CPU; the NVIDIA backend serves them
with Triton kernels (`backends/nvidia/triton_rows.py`) that fix the order per matrix / per row for any
count, so there is no padding and one launch per call (measured on an H200, tiny model, decode through
graphs: the mode's cost fell from +166% to +11.5% at batch 1). Checked on the GPU by the `gpu`-marked
tests in tests/test_repro_*batch_invariant* and packages/deepinfer-model/tests/test_triton_rows.py.
"""

from __future__ import annotations

import torch

TILE_ROWS = 8
DEVICE_BATCH = 16  # matrices per bmm call off the CPU (one problem shape -> one cuBLAS kernel)
GATHER_CHUNK = 4096  # gathered tile products per bmm call in attention (bounds the gathered copies)

# One zero scalar per (device, dtype): padding is its stride-0 expansion, which `torch.cat` reads, so a
# zero-padded operand costs one kernel (the cat) instead of two (a fill, then the cat). On a GPU the
# batch-invariant step is launch-bound and pads many small operands (measured on an H200, tiny model:
# 453 fills and 415 cats in one graphed decode step).
_ZERO: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _zero(x: torch.Tensor) -> torch.Tensor:
    key = (x.device, x.dtype)
    zero = _ZERO.get(key)
    if zero is None:
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        # made during a CUDA-graph capture it would live in the graph's pool: keep only ones made outside
        if not (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _ZERO[key] = zero
    return zero


def _pad0(x: torch.Tensor, pad: int, dim: int = 0) -> torch.Tensor:
    """`x` with `pad` zero slices appended along `dim` (itself when pad is 0), in one kernel."""
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat((x, _zero(x).expand(shape)), dim)


def bmm(a: torch.Tensor, b: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """torch.bmm whose per-matrix results do not depend on the batch count on any device (see the module): on
    the CPU torch.bmm itself; elsewhere the backend's `tile_bmm` op (NVIDIA: one Triton kernel for any
    count; the reference: calls of exactly `DEVICE_BATCH` matrices, the last one zero-padded); with an
    explicit `chunk`, calls of exactly `chunk` matrices on any device."""
    if chunk is None:
        if a.device.type == "cpu":
            return torch.bmm(a, b)
        return _device_ops().tile_bmm(a, b, None, None)
    return chunked_bmm(a, b, chunk)


def chunked_bmm(a: torch.Tensor, b: torch.Tensor, chunk: int = DEVICE_BATCH) -> torch.Tensor:
    """torch.bmm in calls of exactly `chunk` matrices (the last one zero-padded): one problem shape per
    call, so one cuBLAS kernel, and a matrix's result does not depend on which others share its call."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    n = a.shape[0]
    if n == 0:  # e.g. the LM head of a step with no logits rows: nothing to tile
        return a.new_empty(0, a.shape[1], b.shape[2])
    pad = (-n) % chunk
    shared = b.stride(0) == 0  # one broadcast matrix (a weight): stays a stride-0 view, never copied
    # one memory layout for every call (a strided view and its padded copy would differ)
    a = _pad0(a.contiguous(), pad)
    b = b[:1].expand(chunk, *b.shape[1:]) if shared else _pad0(b.contiguous(), pad)
    if n + pad == chunk:  # one call: its output is the result (no concatenation)
        return torch.bmm(a, b)[:n]
    out = [torch.bmm(a[i : i + chunk], b if shared else b[i : i + chunk]) for i in range(0, n + pad, chunk)]
    return torch.cat(out)[:n]


def gathered_chunked_bmm(
    a: torch.Tensor, b: torch.Tensor, ia: torch.Tensor, ib: torch.Tensor
) -> torch.Tensor:
    """a[ia[j]] @ b[ib[j]] for every j as `bmm` calls of gathered (contiguous) matrices, at most
    `GATHER_CHUNK` per call (memory): the reference `tile_bmm` with indices."""
    out = []
    for c in range(0, len(ia), GATHER_CHUNK):
        out.append(bmm(a[ia[c : c + GATHER_CHUNK]], b[ib[c : c + GATHER_CHUNK]]))
    return torch.cat(out) if len(out) != 1 else out[0]


_GET_OPS = None  # `ops.registry.get_ops`, imported at first use (the registry loads the backends, which
# import this package); kept, since an import statement per op call is host time the eager step pays


def _device_ops():
    global _GET_OPS
    if _GET_OPS is None:
        from ..ops.registry import get_ops

        _GET_OPS = get_ops
    return _GET_OPS()


def tiled_matmul(x: torch.Tensor, w_t: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """`x @ w_t` for 2-D `x` [M, K], computed as fixed [TILE_ROWS, K] @ [K, N] products (one bmm of
    `chunk` tiles per call, as `bmm`). The path for accelerators (and for CPU dtypes other than FP64).
    With chunks (off the CPU) the rows are padded at once to whole chunks of tiles (the zero tiles `bmm`
    would append): one copy of `x`."""
    if chunk is None and x.device.type != "cpu":
        chunk = DEVICE_BATCH
    m, k = x.shape
    x = _pad0(x, (-m) % (TILE_ROWS * (chunk or 1)))
    tiles = x.reshape(-1, TILE_ROWS, k)
    # bmm runs one GEMM per tile (the weight is broadcast, not copied); a 3-D @ 2-D matmul would be
    # folded back into one [M, K] GEMM, which is exactly what must not happen.
    out = bmm(tiles, w_t.unsqueeze(0).expand(tiles.shape[0], -1, -1), chunk)
    return out.reshape(-1, w_t.shape[1])[:m]


def _products(a: torch.Tensor, b: torch.Tensor, ia: torch.Tensor, ib: torch.Tensor) -> torch.Tensor:
    """a[ia[j]] @ b[ib[j]] for every j: a [Na, m, k], b [Nb, k, n] -> [len(ia), m, n]. Each product is one
    [m, k] x [k, n] GEMM whatever else shares its call (see `bmm`): off the CPU the backend's `tile_bmm`
    with the indices (NVIDIA: one kernel, no gathered copies), on the CPU `gathered_chunked_bmm`."""
    if a.device.type != "cpu":
        return _device_ops().tile_bmm(a, b, ia, ib)
    return gathered_chunked_bmm(a, b, ia, ib)
