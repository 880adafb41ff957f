"""A request's way through the engine, host side: prompt -> Sequence, stop rules, Sequence ->
RequestOutput."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from docproc.engine.sequence import Sequence
from docproc.models.processor import PromptError
from docproc.outputs import CompletionOutput, RequestMetrics, RequestOutput
from docproc.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


def eos_token_ids(folder: str | Path, hf_config, tokenizer) -> set[int]:
    """EOS ids from generation_config.json, else the model config, else the tokenizer."""
    ids: Any = None
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        tc = getattr(hf_config, "text_config", None)
        ids = getattr(hf_config, "eos_token_id", None) or getattr(tc, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return {int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])}


def make_sequence(processor, prompt: PromptType, sp: SamplingParams, request_id: str, max_model_len: int,
                  images_memo: dict | None = None, grammar=None) -> Sequence:
    """Tokenize the prompt, expand its image placeholders by each image's grid and load the
    images; a constrained request gets its grammar matcher from `grammar` (a callable of the
    StructuredOutputsParams). PromptError for a prompt the engine cannot take."""
    ids, spans, loaded = _processed(processor, prompt, max_model_len, images_memo)
    seq = Sequence(ids, spans, max_tokens=min(sp.max_tokens, max_model_len - len(ids)),
                   request_id=request_id, arrival_time=time.perf_counter())
    seq.mm_inputs = loaded
    seq.sampling = sp
    if sp.structured_outputs is not None:
        try:
            seq.grammar = grammar(sp.structured_outputs, seq.max_tokens)
        except ValueError as e:  # StructuredOutputError: a constraint that does not compile, or no xgrammar
            raise PromptError(str(e)) from None
    return seq


def _processed(processor, prompt: PromptType, max_model_len: int, images_memo: dict | None = None):
    if isinstance(prompt, str):
        text, token_ids, images, uuids = prompt, None, [], None
    elif isinstance(prompt, dict):
        text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        images = (prompt.get("multi_modal_data") or {}).get("image", [])
        if not isinstance(images, (list, tuple)):
            images = [images]
        uuids = (prompt.get("multi_modal_uuids") or {}).get("image")
    else:
        raise PromptError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
    ids, spans, loaded = processor.process(text, token_ids, list(images), uuids, images_memo)
    if len(ids) >= max_model_len:
        raise PromptError(
            f"prompt is {len(ids)} tokens (images expanded), which leaves no room for an answer within "
            f"max_model_len ({max_model_len} tokens, prompt and answer): shorten it or send smaller images "
            f"(max_model_len is the model's max_position_embeddings unless set lower)"
        )
    return ids, spans, loaded


def preload(processor, prompt: PromptType, max_model_len: int) -> tuple[PromptType, int]:
    """The prompt with its images decoded (as the engine takes them, unchanged), and their
    pixels, for a caller that prepares requests away from the engine's thread (the server's
    worker threads): adding it then costs the engine no decoding, and a prompt the engine would
    refuse (PromptError: an image it cannot read, too many tokens) is refused here. processor:
    one of the caller's own (a tokenizer is not shared between threads)."""
    text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
    if isinstance(text, str) and len(text) > 8 * max_model_len:
        # a text that is too long for sure is refused before it is tokenized whole (30 MB of text
        # took a minute and 6 GB): by the longest token's bytes, or by a prefix's tokens
        longest = processor.max_token_bytes
        if len(text) >= longest * max_model_len or \
                len(processor.tokenizer(text[:8 * max_model_len], add_special_tokens=False)["input_ids"]) > \
                max_model_len + 1:
            raise PromptError(f"the prompt's text ({len(text)} characters) is more than the {max_model_len} tokens "
                              f"the engine reads (max_model_len): shorten it")
    _, _, loaded = _processed(processor, prompt, max_model_len)
    if not loaded:
        return prompt, 0
    prompt = {**prompt, "multi_modal_data": {**prompt["multi_modal_data"], "image": loaded}}
    return prompt, sum(im.image.width * im.image.height for im in loaded)


def stop_reason(seq: Sequence, token: int, eos_ids: set[int], tokenizer, max_model_len: int) -> str | None:
    """"stop" (EOS, or a stop string in the text), "length" (max_tokens, max_model_len) or None;
    what stopped it goes to seq.stop_reason; "abort" for a sequence its caller cancelled."""
    if seq.cancelled:
        return "abort"
    sp: SamplingParams = seq.sampling
    if seq.grammar is not None and seq.grammar.is_terminated():  # the constraint is complete
        seq.stop_reason = token
        # closed by its budget (structured.BudgetMatcher): ended by max_tokens, if validly
        return "length" if seq.grammar.steered() else "stop"
    if not sp.ignore_eos and token in eos_ids:
        seq.stop_reason = token
        return "stop"
    if sp.stop:
        # the text's tail only: a stop string that is there now ends in the token just added
        # (earlier tokens were checked when they came). A character is at most 4 bytes and a
        # token at least one, so 4 tokens a character (and 4 for a character cut at the window's
        # start) reach back far enough; a window that decodes shorter (special tokens decode to
        # nothing) is widened until it holds a stop string's length before the newest token's
        # text, or the whole output.
        longest = max(len(s) for s in sp.stop)
        ids = seq.generated_token_ids
        # the stop string's length before the newest token's text, as well as that text
        need = longest + len(tokenizer.decode(ids[-1:], skip_special_tokens=True))
        window = 4 * longest + 4
        while True:
            text = tokenizer.decode(ids[-window:], skip_special_tokens=True)
            if window >= len(ids):
                break
            text = text.lstrip("\ufffd")  # (a character the window's start cut)
            if len(text) >= need:
                break
            window *= 4
        for s in sp.stop:
            if s in text:
                seq.stop_reason = s
                return "stop"
    if seq.num_generated_tokens >= seq.max_tokens or len(seq) >= max_model_len:
        return "length"
    return None


def output_text(seq: Sequence, tokenizer) -> str:
    text = tokenizer.decode(seq.generated_token_ids, skip_special_tokens=True)
    if isinstance(seq.stop_reason, str) and seq.finish_reason == "stop":
        text = text[: text.find(seq.stop_reason)]
    return text


def prompt_text(prompt: PromptType) -> str:
    if isinstance(prompt, str):
        return prompt
    return (prompt.get("prompt") or "") if isinstance(prompt, dict) else ""


def request_output(seq: Sequence, prompt: PromptType, tokenizer) -> RequestOutput:
    if seq.finish_reason == "error":
        return error_output(seq.request_id, prompt, seq.token_ids[: seq.num_prompt_tokens], str(seq.stop_reason))
    end = seq.finish_time or time.perf_counter()
    st = seq.spec_stats
    metrics = RequestMetrics(
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        num_generated_tokens=seq.num_generated_tokens,
        num_images=len(seq.images),
        num_encoded_images=seq.num_encoded_images,
        num_preemptions=seq.num_preemptions,
        draft_proposed=st.proposed,
        draft_accepted=st.accepted,
        draft_verifications=st.verifications,
        draft_bypassed_steps=st.bypassed_steps,
        draft_accepted_length_histogram=dict(sorted(st.accepted_hist.items())),
        draft_k_histogram=dict(sorted(st.k_hist.items())),
        time_to_first_token=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
        total_time=end - seq.arrival_time,
        finish_reason=seq.finish_reason,
    )
    completion = CompletionOutput(0, output_text(seq, tokenizer), seq.generated_token_ids, seq.finish_reason,
                                  seq.stop_reason)
    seq.mm_inputs = []
    return RequestOutput(seq.request_id, prompt_text(prompt), seq.token_ids[: seq.num_prompt_tokens], [completion],
                         metrics)


def error_output(request_id: str, prompt: PromptType, prompt_ids: list[int], error: str) -> RequestOutput:
    return RequestOutput(request_id, prompt_text(prompt), prompt_ids, [CompletionOutput(0, "", [], "error")],
                         RequestMetrics(num_prompt_tokens=len(prompt_ids), finish_reason="error"), error=error)
