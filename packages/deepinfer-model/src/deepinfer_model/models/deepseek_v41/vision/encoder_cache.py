"""Encoder outputs kept by image content hash, so an image sent in many requests is encoded once.

Least recently used entries go first once the cached embedding rows exceed `max_rows`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_rows: int):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._rows = 0
        self.hits = self.misses = 0

    def get(self, digest: str) -> torch.Tensor | None:
        t = self._entries.get(digest)
        if t is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(digest)
        return t

    def put(self, digest: str, embeddings: torch.Tensor) -> None:
        if digest in self._entries:
            self._entries.move_to_end(digest)
            return
        self._entries[digest] = embeddings
        self._rows += embeddings.shape[0]
        while self._rows > self.max_rows and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._rows -= old.shape[0]

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)
