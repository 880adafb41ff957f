"""Vision-tower outputs cached by (vision-weights fingerprint, image content hash), LRU-bounded
by entries and by bytes (the entry just put always stays: the step that put it reads it)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class EncoderCacheStats:
    num_lookups: int = 0  # images a step needed the embeddings of (ModelRunner._image_embeddings)
    num_hits: int = 0  # of those, found without an encode (cached, or encoded for another in the step)
    num_encoded_images: int = 0  # images that went through the vision tower
    num_evictions: int = 0


class EncoderCache:
    def __init__(self, max_entries: int, max_bytes: int | None = None) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()
        self.stats = EncoderCacheStats()

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, str]) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def count(self, hit: bool) -> None:
        """One image a step needed: found without an encode or not (the hit rate's figures; a
        step reads what it encoded through get() too, which counts nothing)."""
        self.stats.num_lookups += 1
        self.stats.num_hits += hit

    def put(self, key: tuple[str, str], value: torch.Tensor) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= _size(old)
        self._entries[key] = value
        self.nbytes += _size(value)
        self.stats.num_encoded_images += 1
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or
                                          (self.max_bytes is not None and self.nbytes > self.max_bytes)):
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= _size(evicted)
            self.stats.num_evictions += 1


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
