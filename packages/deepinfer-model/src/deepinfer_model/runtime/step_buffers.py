"""`StepBuffers`: the runner's persistent host and device buffers for a step's per-token arrays.

A step's input ids, positions, write slots and logits rows are packed into one int64 host buffer (pinned
on CUDA) and sent with ONE asynchronous copy into one device buffer; the step's tensors are views of
it. Buffers grow when a step is larger than any before and are reused otherwise, so a decode step
allocates nothing here. Two sets alternate: a step's tensors stay valid while the next step is
prepared (the asynchronous loop, a draft after `execute`), and on CUDA the host half is rewritten only
after the copy that read it two steps ago has run.
"""

from __future__ import annotations

import numpy as np
import torch

FIELDS = 3  # per-token columns: input id, position, write slot


class _Buffer:
    def __init__(self, size: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.device_buf = torch.empty(size, dtype=torch.long, device=device)
        self.host = torch.empty(size, dtype=torch.long, pin_memory=True) if cuda else self.device_buf
        self.host_np = self.host.numpy()
        self.sent = None  # CUDA event of the last copy out of `host`

    @property
    def size(self) -> int:
        return self.device_buf.numel()


class StepBuffers:
    def __init__(self, device: torch.device, size: int = 1024) -> None:
        self.device = device
        self._sets = [_Buffer(size, device), _Buffer(size, device)]
        self._turn = 0

    def load(
        self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, logits_rows: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, positions, write_slots, logits_rows) as long tensors on the device, views of this
        step's buffer (valid until the step after next is loaded)."""
        n, r = len(positions), len(logits_rows)
        need = FIELDS * n + r
        self._turn ^= 1
        buf = self._sets[self._turn]
        if buf.size < need:
            buf = self._sets[self._turn] = _Buffer(max(need, 2 * buf.size), self.device)
        elif buf.sent is not None:
            buf.sent.synchronize()  # the copy two steps ago has read `host` (long done in practice)
        h = buf.host_np
        h[:n] = input_ids
        h[n : 2 * n] = positions
        h[2 * n : 3 * n] = slots
        h[3 * n : need] = logits_rows
        if buf.host is not buf.device_buf:
            buf.device_buf[:need].copy_(buf.host[:need], non_blocking=True)
            buf.sent = torch.cuda.Event()
            buf.sent.record()
        d = buf.device_buf
        return d[:n], d[n : 2 * n], d[2 * n : 3 * n], d[3 * n : need]
