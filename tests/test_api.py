"""The Python API's edges: arguments checked with messages that name them, vLLM keywords refused
all at once, n outputs per prompt, LLM.chat on OpenAI-style messages, LLM.get_tokenizer. One
bundled-model engine serves the module."""
from __future__ import annotations

import base64
import io
import warnings
from pathlib import Path

import pytest
from PIL import Image

from docproc import LLM, SamplingParams
from docproc.pipeline.queries import SYSTEM_PROMPT, build_prompt

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docproc" / "assets" / "models" / "target"
QUESTION = "What is the invoice total?"


@pytest.fixture(scope="module")
def engine():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(str(TARGET), device="cpu", trust_remote_code=True)
    return llm, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def llm(engine):
    return engine[0]


@pytest.fixture(scope="module")
def page():
    img = Image.open(ROOT / "sample_docs" / "doc_2026_00000.jpg").convert("RGB")
    return img.resize((img.width // 4, img.height // 4))  # ~90 image tokens: a fast vision encode on CPU


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": "8"}, "SamplingParams.max_tokens must be a whole number >= 1, got '8' (str)"),
    ({"max_tokens": True}, "SamplingParams.max_tokens must be a whole number >= 1, got True (bool)"),
    ({"temperature": "hot"}, "SamplingParams.temperature must be a number from 0 (greedy) to 10000, got 'hot' (str)"),
    ({"temperature": float("nan")}, "SamplingParams.temperature must be a number from 0 (greedy) to 10000"),
    ({"temperature": 1e300}, "SamplingParams.temperature must be a number from 0 (greedy) to 10000"),
    ({"top_p": "0.9"}, "SamplingParams.top_p must be a number in (0, 1], got '0.9' (str)"),
    ({"top_k": True}, "SamplingParams.top_k must be a whole number, got True (bool)"),
    ({"top_k": 2.5}, "SamplingParams.top_k must be a whole number, got 2.5 (float)"),
    ({"seed": "x"}, "SamplingParams.seed must be a whole number >= 0 or None, got 'x' (str)"),
    ({"seed": False}, "SamplingParams.seed must be a whole number >= 0 or None, got False (bool)"),
    ({"stop": [1]}, "SamplingParams.stop must be a string or a list of strings, got [1] (list)"),
    ({"ignore_eos": "no"}, "SamplingParams.ignore_eos must be True or False, got 'no' (str)"),
    ({"n": 0}, "SamplingParams.n must be a whole number >= 1, got 0 (int)"),
])
def test_sampling_params_name_the_bad_argument(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_a_temperature_too_small_for_float32_decodes_greedily():
    # 1e-300 is 0 in float32: logits divided by it would be inf and nan (garbage tokens)
    for t in (1e-300, 1e-6):
        sp = SamplingParams(temperature=t)
        assert sp.temperature == 0.0 and sp.is_greedy
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_sampling_params_take_numbers_of_any_numeric_type():
    np = pytest.importorskip("numpy")
    sp = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.int32(3), stop="END")
    assert (sp.max_tokens, sp.temperature, sp.top_k, sp.stop) == (5, 0.5, 3, ["END"])
    assert type(sp.max_tokens) is int and type(sp.temperature) is float


def test_unsupported_vllm_keywords_are_refused_together():
    with pytest.raises(TypeError) as e:
        SamplingParams(temperature=0.5, logprobs=5, presence_penalty=0.1, best_of=2)
    head, _, rest = str(e.value).partition(":")
    assert head == "SamplingParams does not support logprobs, presence_penalty, best_of"
    assert "temperature, top_p, top_k, max_tokens, stop, ignore_eos, seed, structured_outputs, n" in rest


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": "2"}, "LLM.tensor_parallel_size must be a whole number >= 1, got '2' (str)"),
    ({"max_num_seqs": 4.0}, "LLM.max_num_seqs must be a whole number >= 1, got 4.0 (float)"),
    ({"block_size": True}, "LLM.block_size must be a whole number >= 1, got True (bool)"),
    ({"max_model_len": "4096"}, "LLM.max_model_len must be a whole number >= 2 or None, got '4096' (str)"),
    ({"gpu_memory_utilization": "0.5"}, "LLM.gpu_memory_utilization must be a number in (0, 1], got '0.5' (str)"),
    ({"enable_prefix_caching": "yes"}, "LLM.enable_prefix_caching must be True or False, got 'yes' (str)"),
    ({"trust_remote_code": 1}, "LLM.trust_remote_code must be True or False, got 1 (int)"),
    ({"kv_cache_dtype": 4}, "LLM.kv_cache_dtype must be a string, got 4 (int)"),
    ({"num_speculative_tokens": 2.0}, "LLM.num_speculative_tokens must be a whole number >= 1, got 2.0 (float)"),
])
def test_llm_names_the_bad_argument_before_loading(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as e:
        LLM(str(tmp_path / "no-model"), device="cpu", **kwargs)  # a folder that would fail to load otherwise
    assert message in str(e.value)


def test_llm_model_is_a_path():
    with pytest.raises(ValueError, match=r"LLM\.model must be a path \(str or pathlib\.Path\), got 3 \(int\)"):
        LLM(3)


def test_trust_remote_code_is_accepted_with_one_note(engine):
    llm, notes = engine
    assert [n for n in notes if "trust_remote_code" in n] == [
        "LLM(trust_remote_code=True) changes nothing: docproc runs its own model classes, never code from a "
        "model folder"]
    assert llm.generate("hello", SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"


def test_get_tokenizer_is_the_engines(llm):
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer
    assert tok.decode(tok("invoice total", add_special_tokens=False)["input_ids"]) == "invoice total"


def test_n_outputs_per_prompt(llm):
    prompt = build_prompt(0, "Name a vendor.")
    sampled = SamplingParams(temperature=1.0, max_tokens=6, seed=11, ignore_eos=True)
    (out,) = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=6, seed=11, ignore_eos=True, n=3))
    alone = llm.generate([prompt] * 3, [SamplingParams(temperature=1.0, max_tokens=6, seed=11 + i, ignore_eos=True)
                                        for i in range(3)])
    assert [o.index for o in out.outputs] == [0, 1, 2]
    # sequence i draws from seed + i, whatever else runs beside it
    assert [o.token_ids for o in out.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert out.metrics.num_generated_tokens == 18 and out.metrics.num_prompt_tokens == len(out.prompt_token_ids)
    assert llm.generate(prompt, sampled)[0].outputs[0].token_ids == out.outputs[0].token_ids

    (greedy,) = llm.generate(prompt, SamplingParams(max_tokens=6, n=2))
    (once,) = llm.generate(prompt, SamplingParams(max_tokens=6))
    assert [o.index for o in greedy.outputs] == [0, 1]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == once.outputs[0].token_ids
    assert greedy.outputs[0].text == once.outputs[0].text


def png_data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.slow
def test_chat_matches_generate_on_the_hand_built_prompt(llm, page, tmp_path):
    sp = SamplingParams(max_tokens=12)
    png = tmp_path / "page.png"
    page.save(png)
    ref = llm.generate([{"prompt": build_prompt(1, QUESTION), "multi_modal_data": {"image": [page]}},
                        build_prompt(0, "Say hello.")], sp)

    def conversation(image_part):
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": [image_part, {"type": "text", "text": QUESTION}]}]

    # one conversation
    (one,) = llm.chat(conversation({"type": "image_url", "image_url": {"url": png_data_url(page)}}), sp)
    # several: an image as a PIL image, a path, a file:// URL; a text-only conversation
    many = llm.chat([conversation({"type": "image", "image": page}),
                     conversation({"type": "image", "image": str(png)}),
                     conversation({"type": "image_url", "image_url": {"url": png.as_uri()}}),
                     [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Say hello."}]], sp)
    for out, want in zip([one, *many], [ref[0]] * 4 + [ref[1]]):
        assert out.error is None
        assert out.prompt == want.prompt
        assert out.prompt_token_ids == want.prompt_token_ids
        assert out.outputs[0].token_ids == want.outputs[0].token_ids and out.outputs[0].text == want.outputs[0].text
    assert ref[0].outputs[0].text  # the model answers the question, not nothing


@pytest.mark.parametrize("messages, message", [
    ([], "messages must be a non-empty list of messages"),
    ("hello", "messages must be a non-empty list of messages"),
    ([{"content": "hi"}], "messages[0]['role'] must be a non-empty string"),
    ([{"role": "user", "content": 3}], "messages[0]['content'] must be a string or a list of parts, got 3 (int)"),
    ([{"role": "user", "content": [{"type": "audio_url"}]}],
     "messages[0]['content'][0] must be a dict whose 'type' is one of text, image_url, image, image_pil"),
    ([{"role": "user", "content": ["hi"]}], "messages[0]['content'][0] must be a dict whose 'type'"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], "messages[0]['content'][0]['text'] must be"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}],
     "is on the network and docproc fetches nothing"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://host/a.png"}}]}],
     "ftp:// URLs are not supported"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}],
     "the data: URL's base64 does not decode"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:text/plain,hi"}}]}],
     "a data: URL must be base64"),
    ([{"role": "user", "content": [{"type": "image", "image": 7}]}],
     "messages[0]['content'][0]['image'] must be a PIL image, a path or a data: URL"),
    ([{"role": "user", "content": "look: <|image_pad|>"}], "has 1 <|image_pad|> for 0 image(s)"),
    ([[{"role": "user", "content": "fine"}], [{"role": "user", "content": 3}]], "messages[1][0]['content']"),
])
def test_chat_refuses_bad_messages_by_name(llm, messages, message):
    with pytest.raises(ValueError) as e:
        llm.chat(messages)
    assert message in str(e.value)
