"""Sequence: pure bookkeeping for one request over integer token lists (no torch here)."""
from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass
from enum import Enum

from docproc.multimodal import ImageSpan  # noqa: F401 -- defined there (models use it too), named here
from docproc.outputs import SpecStats


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request's tokens and its place in the KV cache.

    Invariant: the KV of token_ids[:num_computed_tokens] is in the blocks of block_table, and the
    table has room for every token scheduled so far. `block_hashes[i]` is the chained hash of
    block i once that block is full and committed.
    """

    _ids = itertools.count()

    def __init__(
        self,
        token_ids: list[int],
        images: list[ImageSpan] | None = None,
        *,
        max_tokens: int = 64,
        request_id: str | None = None,
        arrival_time: float = 0.0,
    ) -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.images = list(images or [])
        self.max_tokens = max_tokens
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # tokens at the end of token_ids that a step in flight is sampling (engine/overlap.py):
        # placeholders until the host reads them, never keyed into the prefix cache
        self.num_placeholders = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (first admission)
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_encoded_images = 0
        self.spec_stats = SpecStats()  # speculative decoding figures of this request
        self.draft = None  # the draft model's view of this sequence (engine/spec/draft.py)
        # Opaque payloads owned by the engine layers above: the decoded images (one per span),
        # the request's sampling parameters and its random generator.
        self.mm_inputs: list = []
        self.images_prefetched = False  # every image's preprocessing started or its encode cached
        self.images_counted = False  # its images counted in the vision cache's lookups (once a sequence)
        self.sampling = None
        self.generator = None
        self.grammar = None  # a structured-output request's grammar matcher (engine/structured.py)
        self.cancelled = False  # its caller gave it up (LLM.cancel): it stops at its next token
        # text position offset of tokens after the last image (M-RoPE): pos(i) = i + mrope_delta
        self.mrope_delta = sum(im.position_span - im.num_tokens for im in self.images)
        for a, b in zip(self.images, self.images[1:]):
            if b.offset < a.end:
                raise ValueError("image spans overlap")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def block_key(self, block_index: int, block_size: int) -> bytes:
        return block_key(self.token_ids, self.images, block_index, block_size)


@dataclass
class Chunk:
    """The step unit: positions start..end of a (draft) sequence to compute, what the scheduler
    plans and ModelRunner.forward takes. `window` holds tokens past the sequence's end (a
    speculative step's proposals, scored by the target beside the sequence, never appended to
    it): end may reach len(seq) + len(window)."""

    seq: object
    start: int
    end: int
    window: tuple[int, ...] = ()

    @classmethod
    def next(cls, seq, num_new_tokens: int) -> Chunk:
        """The seq's next num_new_tokens positions, from what it has computed."""
        start = seq.num_computed_tokens
        return cls(seq, start, start + num_new_tokens)

    @property
    def num_new_tokens(self) -> int:
        return self.end - self.start

    @property
    def needs_sample(self) -> bool:
        """True once this step computes the last known token: its logits give the next one."""
        return self.end == len(self.seq)

    def input_ids(self) -> list[int]:
        ids = self.seq.token_ids
        n = len(ids)
        if self.end <= n:
            return ids[self.start: self.end]
        return ids[self.start:] + list(self.window[: self.end - n])


def block_key(token_ids: list[int], images: list[ImageSpan], block_index: int, block_size: int) -> bytes:
    """Bytes that identify block `block_index`'s content given everything before it.

    Text tokens are keyed by id. Image-pad tokens all share one id, so a block that overlaps
    an image also carries the image's content hash and which of its tokens the block holds:
    the same tokens next to a different image never produce the same key.
    """
    start, end = block_index * block_size, (block_index + 1) * block_size
    key = array("i", token_ids[start:end]).tobytes()
    for im in images:
        if im.offset < end and im.end > start:
            lo, hi = max(start, im.offset), min(end, im.end)
            key += b"|img:" + im.content_hash.encode() + b":%d:%d:%d" % (lo - start, lo - im.offset, hi - lo)
    return key
