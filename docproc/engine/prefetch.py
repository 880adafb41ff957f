"""Image preprocessing ahead of the vision encode, on a small thread pool.

Turning a page into the vision tower's input (resize, normalise, cut into patches) is CPU work,
~40 ms for an 868 x 1092 page. Done inline, the accelerator waits for it at every step that
starts new pages. The prefetcher starts it for the pages of sequences that are queued or about to
prefill, so that by the time a step encodes them their pixel values (pinned, on CUDA) are ready.
The processor's per-image outputs, concatenated, are exactly its batched output (patch rows
concatenated, one grid row per image), so encodes are bit-identical with and without prefetching.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def default_workers(device: torch.device) -> int:
    """Threads for preprocessing: none on a CPU engine (the forward uses every core; preprocessing
    inline is as fast), up to 8 (half the cores) beside a GPU."""
    if device.type != "cuda":
        return 0
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class ImagePrefetcher:
    """Pixel values by image content hash: `prefetch` starts them, `take` returns them (waiting
    for a started one, computing a missing one inline). At most `max_pending` images are started
    and not yet taken (an 868 x 1092 page is ~23 MB of float32 patches); beyond that, `prefetch`
    starts nothing until `take` has collected some. A pinned result's host-to-device copy is
    non-blocking: PyTorch's pinned-memory allocator keeps the block until the copy is done."""

    def __init__(self, processor, workers: int, pin: bool, max_pending: int = 32) -> None:
        self.processor = processor
        self.workers = workers
        self.pin = pin
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="docproc-pixels") if workers > 0 else None
        self._pending: OrderedDict[str, Future] = OrderedDict()
        self.num_prefetched = 0  # images whose pixels were started ahead and then taken
        self.num_inline = 0  # images computed inline in `take`
        self.take_seconds = 0.0  # time `take` spent waiting for started images or computing missing ones

    def _compute(self, image):
        pixels, grid = self.processor.pixel_values([image])
        if self.pin:
            pixels = pixels.pin_memory()
        return pixels, grid

    def prefetch(self, items) -> None:
        """items: (content hash, PIL image) pairs, in the order they will be needed."""
        if self._pool is None:
            return
        for h, image in items:
            if len(self._pending) >= self.max_pending:
                return
            if h not in self._pending:
                self._pending[h] = self._pool.submit(self._compute, image)

    def pending(self, h: str) -> bool:
        return h in self._pending

    def ready(self, h: str) -> bool:
        """Started and done: `take` would not wait for it."""
        fut = self._pending.get(h)
        return fut is not None and fut.done()

    def take(self, items) -> tuple[list[torch.Tensor], torch.Tensor]:
        """items: (content hash, PIL image) pairs. Their pixel values (one tensor per image) and grids
        (num_images, 3), in order."""
        pixels, grids = [], []
        t0 = time.perf_counter()
        for h, image in items:
            fut = self._pending.pop(h, None)
            if fut is not None:
                p, g = fut.result()
                self.num_prefetched += 1
            else:
                p, g = self._compute(image)
                self.num_inline += 1
            pixels.append(p)
            grids.append(g)
        self.take_seconds += time.perf_counter() - t0
        return pixels, torch.cat(grids)

    def forget(self, hashes) -> None:
        """Forget the started work of these images (a cancelled request's pages that no other
        request needs): their pinned results are let go, and their places are free for others."""
        for h in hashes:
            fut = self._pending.pop(h, None)
            if fut is not None:
                fut.cancel()

    def drop(self) -> None:
        """Forget started work (its results are not needed: e.g. the requests were aborted)."""
        self.forget(list(self._pending))

    def close(self) -> None:
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
