"""Which tokenizer files a checkpoint folder needs (torch-free: the pipeline checks a folder with
it before anything loads).

tokenizer.json (the fast tokenizer, what Qwen2-VL checkpoints ship) is enough. Without it,
transformers builds the fast tokenizer from vocab.json and merges.txt (the slow BPE files) when
tokenizer_config.json names a Qwen2 tokenizer class; the generic backend classes need
tokenizer.json itself.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
BPE_FILES = ("vocab.json", "merges.txt")


def special_files(folder: str | Path) -> str | None:
    """The folder's entries that are FIFOs, sockets or devices (through links), as a clause that
    follows the folder's name, or None. Opening a FIFO waits for a writer, so a tokenizer or config
    file that is one would hang the load instead of failing it."""
    odd = []
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return None  # (the caller's own checks name an unreadable folder)
    for entry in entries:
        try:
            mode = entry.stat().st_mode  # follows a link: what an open would reach
        except OSError:
            continue  # a broken link: read errors name it where it matters
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            odd.append(entry.name)
    if not odd:
        return None
    return f"holds {', '.join(odd[:5])}{' ...' if len(odd) > 5 else ''}, not regular files (a FIFO, socket or device " \
           f"would hang or break the load): remove {'it' if len(odd) == 1 else 'them'} or use a copy of the checkpoint"


def tokenizer_class(folder: str | Path) -> str | None:
    """The class tokenizer_config.json names, or None (no file, not JSON, no name)."""
    try:
        named = json.loads((Path(folder) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return named if isinstance(named, str) else None


def missing_tokenizer(folder: str | Path) -> str | None:
    """What keeps the folder's tokenizer from loading, as a clause that follows the folder's name
    ("has no tokenizer.json ..."), or None when its files are there."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return None
    have_bpe = all((folder / f).is_file() for f in BPE_FILES)
    named = tokenizer_class(folder)
    if have_bpe and named not in GENERIC_TOKENIZERS:
        return None
    if have_bpe:
        return (f"has no tokenizer.json, which its tokenizer class {named} needs (vocab.json and merges.txt do "
                f"only for a Qwen2 tokenizer): copy tokenizer.json from the checkpoint it was made from")
    return ("has no tokenizer.json (nor vocab.json and merges.txt): copy the tokenizer files from the checkpoint "
            "it was made from")
