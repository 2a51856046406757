"""The indexer's top-k keys (`topk_keys`) as one Triton kernel.

Why: the top-k of 16-bit index scores ranks unique int32 keys (`layers.indexer._select_topk_keys`). Built
with torch ops (two `where`s and an add over [T, n], their int16 / int32 temporaries) the keys cost as much
as the top-k itself: 3.4 of 7.3 ms per [16k, 16k] call on an H100. Here each element is read once (2 bytes of
score, 1 of validity) and its key written once (4 bytes). Plain `.py` (Triton reads the source).
"""

import torch
import triton
import triton.language as tl

BLOCK = 1024  # entries per program


@triton.jit
def score_key16(bits):
    """A 16-bit score's int32-widened sign-magnitude bits as two's complement: ordered like the scores,
    -0.0 and +0.0 both 0, -32767 .. 32767 (the key16 of `topk_keys` and `triton_select`)."""
    return tl.where(bits < 0, -32768 - bits, bits)


@triton.jit
def _keys_kernel(bits_ptr, valid_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = j < n
    bits = tl.load(bits_ptr + row * n + j, mask=ok, other=0).to(tl.int32)  # (sign-extended)
    valid = tl.load(valid_ptr + row * n + j, mask=ok, other=0)
    k16 = tl.where(valid != 0, score_key16(bits), -32768)
    tl.store(out_ptr + row * n + j, k16 * 65536 + (65535 - j), mask=ok)


def topk_keys(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The registry's `topk_keys` contract."""
    t, n = scores.shape
    if scores.dtype not in (torch.bfloat16, torch.float16) or valid.dtype != torch.bool or n > 1 << 16:
        raise ValueError(
            f"topk_keys: 16-bit scores and bool valid [T, n <= 65536], got {scores.dtype} {tuple(scores.shape)}, "
            f"{valid.dtype} {tuple(valid.shape)}"
        )
    out = torch.empty(t, n, dtype=torch.int32, device=scores.device)
    if t and n:
        bits = scores.contiguous().view(torch.int16)
        _keys_kernel[(t, -(-n // BLOCK))](bits, valid.contiguous().view(torch.uint8), out, n, BLOCK=BLOCK)
    return out
