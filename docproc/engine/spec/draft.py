"""The draft model's side of speculative decoding (no torch): its view of each sequence and the
tokenizer agreement check.

A DraftView is what the draft's block manager and runner see of a Sequence: the draft's own
prompt (the target's, or the target's without image pads when the draft gets no vision), the
generated tokens, the proposals of the current step, and the draft's own block table and computed
length -- so rollback after rejected proposals is a length change in the draft's cache too.
"""
from __future__ import annotations

import hashlib
import json

from docproc.engine.sequence import ImageSpan, Sequence, block_key


class DraftView:
    def __init__(self, seq: Sequence, prompt_ids: list[int], images: list[ImageSpan], mm_inputs: list) -> None:
        self.seq = seq
        self.prompt_ids = prompt_ids
        self.images = images
        self.mm_inputs = mm_inputs
        self.proposals: list[int] = []
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_encoded_images = 0
        self.images_counted = False  # (the draft runner's vision cache lookups, counted once)
        self.num_placeholders = 0  # (a draft's tokens are always known)

    # what BlockManager and ModelRunner read
    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def num_preemptions(self) -> int:
        return self.seq.num_preemptions

    @property
    def sampling(self):
        return self.seq.sampling

    @property
    def generator(self):
        return self.seq.generator

    @generator.setter
    def generator(self, g) -> None:
        self.seq.generator = g

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.seq.generated_token_ids + self.proposals

    def __len__(self) -> int:
        return len(self.prompt_ids) + self.seq.num_generated_tokens + len(self.proposals)

    @property
    def num_committed(self) -> int:
        """Tokens that are part of the sequence (not proposals)."""
        return len(self.prompt_ids) + self.seq.num_generated_tokens

    def block_key(self, block_index: int, block_size: int) -> bytes:
        return block_key(self.token_ids, self.images, block_index, block_size)


def draft_prompt(seq: Sequence, mode: str, image_token_id: int) -> tuple[list[int], list[ImageSpan], list]:
    """The draft's prompt: the target's ("own"/"auto" vision), or with every image's pad tokens
    dropped ("none": the draft sees only the text)."""
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    if mode != "none" or not seq.images:
        return list(prompt), list(seq.images), list(seq.mm_inputs)
    keep = [t for i, t in enumerate(prompt) if not any(im.offset <= i < im.end for im in seq.images)]
    return keep, [], []


def tokenizer_hash(tokenizer) -> str:
    """Vocabulary and special tokens, hashed: two tokenizers with the same hash encode alike."""
    vocab = sorted(tokenizer.get_vocab().items())
    specials = sorted(str(t) for t in tokenizer.all_special_tokens)
    added = sorted((str(k), v) for k, v in tokenizer.get_added_vocab().items())
    payload = json.dumps({"vocab": vocab, "special": specials, "added": added}, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _family(folder: str) -> str | None:
    """A checkpoint's model family from its config.json (None where it cannot be read: the load
    names that)."""
    import json
    from pathlib import Path

    try:
        model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return {"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2-VL", "qwen3_vl": "Qwen3-VL"}.get(model_type)


def check_tokenizers(target: str, draft: str) -> None:
    """The draft must encode text exactly as the target does; checked before any weights load."""
    from docproc.models.loader import CheckpointError, check_folder
    from docproc.models.processor import load_tokenizer
    from docproc.models.tokenizer_files import missing_tokenizer

    for what, folder in (("model", target), ("draft", draft)):
        check_folder(folder)  # a missing folder is named as such, not looked up on a model hub
        missing = missing_tokenizer(folder)
        if missing is not None:
            raise CheckpointError(f"{what} folder {folder} {missing}")
    families = [_family(p) for p in (target, draft)]
    if None not in families and families[0] != families[1]:
        raise ValueError(f"the draft is a {families[1]} model and the target a {families[0]} one: pick a draft of "
                         f"the target's family (their tokenizers, image tokens and positions differ)")
    hashes = [tokenizer_hash(load_tokenizer(p)) for p in (target, draft)]
    if hashes[0] != hashes[1]:
        raise ValueError(f"draft tokenizer differs from target (vocab hash {hashes[1]} vs {hashes[0]}): "
                         f"pick a draft trained with the same tokenizer")
