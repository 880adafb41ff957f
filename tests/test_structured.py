"""Structured outputs on a random tiny model (which would otherwise emit noise): every output that
ends by itself is valid for its constraint; a constraint that does not compile fails its request
alone; with a draft (proposing under the grammar, verified under it) the output is token for token
that of constrained decoding without it, and sampled output keeps its distribution."""
from __future__ import annotations

import json
import re

import pytest

from docproc import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")

PROMPT = "<|im_start|>user\nRead the invoice.<|im_end|>\n<|im_start|>assistant\n"

SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
     "required": ["n", "ok"], "additionalProperties": False},
    {"type": "object", "additionalProperties": False, "required": ["vendor", "kind", "lines", "addr"],
     "properties": {"vendor": {"type": "string", "maxLength": 6}, "kind": {"enum": ["invoice", "receipt"]},
                    "lines": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2},
                    "addr": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{4}$"}},
                             "required": ["zip"], "additionalProperties": False}}},
    {"anyOf": [{"type": "null"}, {"type": "string", "format": "date"}]},
]


def valid(schema: dict, value) -> bool:
    """The few JSON Schema rules SCHEMAS use, checked by hand."""
    if "anyOf" in schema:
        return any(valid(s, value) for s in schema["anyOf"])
    if "enum" in schema:
        return value in schema["enum"]
    t = schema.get("type")
    if t == "null":
        return value is None
    if t == "boolean":
        return isinstance(value, bool)
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool) and \
            schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if t == "string":
        if not isinstance(value, str) or len(value) > schema.get("maxLength", len(value)):
            return False
        if schema.get("format") == "date" and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
            return False
        return "pattern" not in schema or re.search(schema["pattern"], value) is not None
    if t == "array":
        return isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)) and \
            all(valid(schema["items"], v) for v in value)
    if t == "object":
        props = schema.get("properties", {})
        return isinstance(value, dict) and all(k in value for k in schema.get("required", [])) and \
            (schema.get("additionalProperties", True) or set(value) <= set(props)) and \
            all(valid(props[k], v) for k, v in value.items() if k in props)
    raise AssertionError(f"schema rule not covered: {schema}")


@pytest.fixture(scope="module")
def llm(qwen2_vl_dir):
    return LLM(str(qwen2_vl_dir), device="cpu")


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_are_valid(llm, schema, temperature):
    sp = [SamplingParams(max_tokens=160, temperature=temperature, seed=i,
                         structured_outputs=StructuredOutputsParams(json=schema)) for i in range(4)]
    outs = llm.generate([PROMPT + str(i) for i in range(4)], sp)
    stopped = [o for o in outs if o.outputs[0].finish_reason == "stop"]
    assert stopped, [o.outputs[0].text for o in outs]
    for o in stopped:
        assert valid(schema, json.loads(o.outputs[0].text)), o.outputs[0].text
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=20))[0].outputs[0].text
    with pytest.raises(ValueError):
        json.loads(plain)  # unconstrained, the random model writes noise


def test_choice_and_regex(llm):
    choices = ["paid", "unpaid", "partly paid"]
    outs = llm.generate([PROMPT + str(i) for i in range(6)],
                        [SamplingParams(max_tokens=20, temperature=1.0, seed=i,
                                        structured_outputs=StructuredOutputsParams(choice=choices))
                         for i in range(3)]
                        + [SamplingParams(max_tokens=20, temperature=1.0, seed=i,
                                          structured_outputs=StructuredOutputsParams(regex=r"INV-[0-9]{3,5}"))
                           for i in range(3)])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].text in choices for o in outs[:3])
    assert all(re.fullmatch(r"INV-[0-9]{3,5}", o.outputs[0].text) for o in outs[3:])


def test_a_constraint_that_does_not_compile_fails_its_request_alone(llm):
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    outs = llm.generate([PROMPT, PROMPT, PROMPT],
                        [SamplingParams(max_tokens=8, structured_outputs=bad), SamplingParams(max_tokens=8),
                         SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))])
    assert outs[0].outputs[0].finish_reason == "error"
    assert "json constraint does not compile" in outs[0].error and "nowhere" in outs[0].error
    assert not outs[0].error.startswith("[")  # xgrammar's log prefix is cut
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 8
    assert outs[2].outputs[0].text in ("a", "b")


def test_a_constraint_compiled_ahead_in_another_thread_is_not_compiled_again(llm, monkeypatch):
    """LLM.compile_constraint (the server calls it in its own threads) fills the cache the
    engine's matcher reads: the request itself compiles nothing; one that does not compile
    raises there, with the engine's message."""
    import threading

    so = StructuredOutputsParams(json={"type": "string", "pattern": "^[a-c]{2,3}$"})
    t = threading.Thread(target=llm.compile_constraint, args=(so,))
    t.start()
    t.join()
    compiler = llm.runner.grammar._compiler
    calls = []
    real = type(compiler).compile_grammar
    monkeypatch.setattr(type(compiler), "compile_grammar", lambda self, g: calls.append(g) or real(self, g))
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, structured_outputs=so))[0]
    assert re.fullmatch(r'"[a-c]{2,3}"', out.outputs[0].text) and calls == []
    with pytest.raises(ValueError, match="json constraint does not compile"):
        llm.compile_constraint(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/x"}}}))


def test_parameters_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "null"}, regex="x")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="regex must be a string"):
        StructuredOutputsParams(regex=re.compile("a+"))
    with pytest.raises(ValueError, match="json schema is not JSON"):
        StructuredOutputsParams(json={"enum": {1, 2}})
    for endless in ({"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
                    '{"type": "array", "minItems": 1, "items": {"$ref": "#"}}'):
        with pytest.raises(ValueError, match="no finite JSON value matches the subschema at the root"):
            StructuredOutputsParams(json=endless)
    with pytest.raises(ValueError, match="stop strings and structured_outputs"):
        SamplingParams(stop=["}"], structured_outputs=StructuredOutputsParams(json={"type": "null"}))


def test_schema_text_that_is_not_json_fails_its_request_alone(llm):
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(structured_outputs=StructuredOutputsParams(json="{oops")),
                                           SamplingParams(max_tokens=4)])
    assert outs[0].outputs[0].finish_reason == "error" and "not valid JSON" in outs[0].error
    assert outs[1].error is None


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A draft with other random weights (the target's tokenizer): most proposals are rejected,
    some of them tokens the grammar refuses."""
    from fixtures.checkpoints import make_model

    return make_model(tmp_path_factory.mktemp("other_draft"), "qwen2_vl", seed=1)


@pytest.mark.parametrize("draft", ["target", "other"])
@pytest.mark.slow
def test_with_a_draft_constrained_output_is_that_without_it(qwen2_vl_dir, other_draft, llm, draft):
    """Constrained rows draft under their grammar and are verified under it at every window
    position, beside an unconstrained row: each row's tokens equal the engine's without a draft.
    With the target as its own draft every proposal is accepted (the draft's masks are the
    target's); with another draft proposals are rejected and the matchers rolled back. The
    windows are masked with the draft's masks where it made them."""
    folder = str(qwen2_vl_dir if draft == "target" else other_draft)
    spec = LLM(str(qwen2_vl_dir), device="cpu", speculative_model=folder, num_speculative_tokens=3)
    sps = [SamplingParams(max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMAS[1])),
           SamplingParams(max_tokens=24, ignore_eos=True),
           SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"INV-[0-9]{3,5}")),
           SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(choice=["paid", "unpaid", "void"]))]
    prompts = [PROMPT + "a", PROMPT + "b", PROMPT + "c", PROMPT + "d"]
    outs = spec.generate(prompts, sps)
    without = [o.outputs[0].token_ids for o in llm.generate(prompts, sps)]
    assert [o.outputs[0].token_ids for o in outs] == without
    proposed = [o.metrics.draft_proposed for o in outs]
    accepted = [o.metrics.draft_accepted for o in outs]
    assert proposed[0] > 0 and proposed[2] > 0, proposed  # the constrained rows drafted
    # the verification took the draft's masks at the positions it had masked (not filled again)
    assert spec.runner.grammar.num_reused_masks > 0
    if draft == "target":
        assert accepted == proposed, (accepted, proposed)
    else:
        assert accepted[0] < proposed[0], (accepted, proposed)


@pytest.mark.slow
def test_sampled_constrained_speculation_keeps_the_distribution(qwen2_vl_dir, other_draft, llm):
    """Sampled (temperature 2) under a regex, with another model as the draft: the outputs'
    distribution equals constrained sampling without a draft (a two-sample chi-square test over
    the strings, categories under 5 expected merged; seeds make it deterministic)."""
    spec = LLM(str(qwen2_vl_dir), device="cpu", speculative_model=str(other_draft), num_speculative_tokens=3)
    n = 600
    so = StructuredOutputsParams(regex=r"[xz]{4}")
    sps = [SamplingParams(temperature=2.0, max_tokens=12, seed=i, structured_outputs=so) for i in range(n)]
    a = [o.outputs[0].text for o in llm.generate([PROMPT] * n, sps)]
    b_outs = spec.generate([PROMPT] * n, [SamplingParams(temperature=2.0, max_tokens=12, seed=10_000 + i,
                                                         structured_outputs=so) for i in range(n)])
    b = [o.outputs[0].text for o in b_outs]
    assert all(re.fullmatch(r"[xz]{4}", t) for t in a + b)
    assert sum(o.metrics.draft_proposed for o in b_outs) > n  # speculation ran
    cats = sorted(set(a) | set(b))
    counts = [(a.count(c), b.count(c)) for c in cats]
    merged, rest = [], (0, 0)
    for ca, cb in sorted(counts, key=lambda x: x[0] + x[1]):
        if (ca + cb) / 2 < 5:
            rest = (rest[0] + ca, rest[1] + cb)
        else:
            merged.append((ca, cb))
    if sum(rest) > 0:
        merged.append(rest)
    assert len(merged) >= 4, counts  # a distribution worth testing
    chi2 = sum((ca - cb) ** 2 / (ca + cb) for ca, cb in merged if ca + cb)
    # 0.999 quantile of chi-square with len(merged) - 1 degrees of freedom (Wilson-Hilferty)
    dof = len(merged) - 1
    bound = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < bound, (chi2, bound, counts)


def test_properties_come_in_the_schema_order(llm):
    """The output writes an object's properties in the schema's order (not sorted): a model trained
    to answer vendor first must not be made to write its vendor under another key."""
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha"],
              "properties": {"zeta": {"enum": ["z"]}, "alpha": {"enum": ["a"]}}}
    for so in (StructuredOutputsParams(json=schema), StructuredOutputsParams(json=json.dumps(schema))):
        out = llm.generate([PROMPT], SamplingParams(max_tokens=40, structured_outputs=so))[0].outputs[0].text
        assert out == '{"zeta": "z", "alpha": "a"}', out


@pytest.mark.slow
def test_overlapped_decode_with_constrained_rows_gives_the_plain_tokens(qwen2_vl_dir, monkeypatch):
    """Constrained rows take the overlapped decode path (the next step's forward queued before the
    tokens are read, its masks filled and its sampling queued after the matchers took them): the
    same tokens as decoding step by step, for greedy and seeded sampled rows beside free ones."""
    from docproc.engine import model_runner

    schema = SCHEMAS[0]
    params = [SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=1.0, seed=3,
                             structured_outputs=StructuredOutputsParams(regex=r"INV-[0-9]{3,12}")),
              SamplingParams(max_tokens=16, temperature=0.8, seed=5,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[1]))]
    prompts = [PROMPT + str(i) for i in range(len(params))]
    got = {}
    for overlap in (False, True):
        with monkeypatch.context() as m:
            m.setattr(model_runner, "resolve_step_graphs", lambda config, device: "static")
            eng = LLM(str(qwen2_vl_dir), device="cpu", max_num_seqs=2, overlap_decode=overlap)
            outs = eng.generate(prompts, params)
        got[overlap] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]
        # (two places: the last two requests are admitted by overlapped steps as the first ones stop)
        assert eng.num_overlapped_steps == (eng.num_steps - 1 if overlap else 0)
    assert got[True] == got[False]
    (_, why0, text0), _, (_, why2, text2), _ = got[True]
    assert why0 == "stop" and valid(schema, json.loads(text0)), text0
    assert why2 == "stop" and re.fullmatch(r"INV-[0-9]{3,12}", text2), text2


@pytest.mark.gpu
def test_cuda_overlapped_decode_with_constrained_rows_gives_the_plain_tokens(qwen2_vl_dir):
    """On CUDA graphs: constrained rows overlapped (masks filled in a pinned buffer while the
    forward runs) give the tokens of step-by-step decoding in float32."""
    params = [SamplingParams(max_tokens=150, structured_outputs=StructuredOutputsParams(json=SCHEMAS[1])),
              SamplingParams(max_tokens=40, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                             structured_outputs=StructuredOutputsParams(regex=r"INV-[0-9]{3,30}"))]
    prompts = [PROMPT + str(i) for i in range(len(params))]
    got = {}
    for overlap in (False, True):
        eng = LLM(str(qwen2_vl_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20,
                  overlap_decode=overlap)
        got[overlap] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in eng.generate(prompts, params)]
        assert (eng.num_overlapped_steps >= 10) == overlap
        del eng
    assert got[True] == got[False]


def test_the_device_mask_kernel_equals_xgrammars():
    """kernels/token_mask.py (CUDA's path: one kernel, no index tensor; here in Triton's
    interpreter) and its torch reference against xgrammar's own apply, on random masks over a
    tokenizer of 1,000 ids (not a multiple of 32) and logits 24 ids wider: those ids are -inf in
    the constrained rows and untouched in the row without a constraint (tail 1)."""
    import torch
    import xgrammar as xgr

    from kernels.token_mask import apply_token_mask, apply_token_mask_ref

    g = torch.Generator().manual_seed(0)
    width = 1000
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, (width + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[3] = -1  # row 3: no constraint (what _apply writes for it)
    tail = torch.tensor([0, 0, 0, 1, 0], dtype=torch.int32)
    logits = torch.randn(5, width + 24, generator=g)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=width)
    want[[0, 1, 2, 4], width:] = float("-inf")
    for apply in (apply_token_mask_ref, apply_token_mask):
        got = logits.clone()
        apply(got, bitmask, tail, width)
        assert torch.equal(got, want) and torch.isinf(got).any(), apply.__name__
        assert not torch.isinf(got[3]).any()
    # bf16 logits, as on the GPU
    got = logits.to(torch.bfloat16)
    apply_token_mask(got, bitmask, tail, width)
    assert torch.equal(torch.isinf(got), torch.isinf(want))


def test_a_padded_vocabulary_stays_outside_the_grammar(llm):
    """A model whose logits are wider than its tokenizer (embeddings padded): xgrammar sees only
    the tokenizer's ids (its masks and matchers would otherwise carry every padded id), and a
    constrained row never samples an id past them, while a free row still may."""
    import torch

    from docproc.engine.structured import GrammarCompiler, tokenizer_size
    from docproc.sampling_params import StructuredOutputsParams

    known = tokenizer_size(llm.tokenizer)
    gc = GrammarCompiler(llm.tokenizer, known + 500, llm.eos_token_ids)
    assert gc.num_tokens == known
    logits = torch.zeros(2, known + 500)
    logits[:, known:] = 10.0  # the padded ids would win every argmax
    m = gc.matcher(StructuredOutputsParams(regex="[0-9]+"), 16)
    gc.mask_rows(logits, [m, None])
    assert int(logits[0].argmax()) < known and torch.isinf(logits[0, known:]).all()
    assert int(logits[1].argmax()) >= known  # the free row: untouched


def test_the_masks_are_filled_on_the_thread_count_measured_fastest(llm):
    """FillThreads times each thread count on the calls it fills (a clock given to it here), per
    bucket of row counts, then takes the fastest, timing the others again every REMEASURE calls;
    the masks xgrammar writes are the same whatever the count."""
    from types import SimpleNamespace

    import torch

    from docproc.engine.structured import FillThreads, GrammarCompiler, tokenizer_size

    now = [0.0]
    cost = {1: 1.0, 2: 0.5, 4: 3.0}  # seconds a call, by thread count: 2 is fastest
    first = {1: 50.0, 2: 60.0, 4: 70.0}  # a count's first call: its warm-up, not counted
    used = []

    class Batch:
        def __init__(self, max_threads):
            self.threads = max_threads

        def batch_fill_next_token_bitmask(self, matchers, bitmask, rows):
            used.append((len(rows), self.threads))
            now[0] += first.pop(self.threads, None) or cost[self.threads]

    fills = FillThreads(SimpleNamespace(BatchGrammarMatcher=Batch), cores=8, clock=lambda: now[0])
    assert fills.counts == (1, 2, 4)
    for _ in range(130):
        fills.fill([None] * 64, None, list(range(64)))
    threads = [t for _, t in used]
    assert threads[:6] == [1, 1, 2, 2, 4, 4]  # each timed twice (the first call warms it up)
    assert threads[6:64] == [2] * 58  # then the fastest
    assert threads[64] == 2 and threads[128] == 4  # timed again in turn (4 once more, then left)
    assert threads.count(2) == 125
    cost[2] = 9.0  # the fastest turns slow: its own calls time it, so it is left within a few
    for _ in range(70):
        fills.fill([None] * 64, None, list(range(64)))
    assert [t for _, t in used[-5:]] == [1] * 5
    fills.fill([None] * 3, None, [0, 1, 2])  # another bucket of rows: timed afresh
    assert used[-1] == (3, 1)
    assert FillThreads(SimpleNamespace(BatchGrammarMatcher=Batch), cores=2).counts == (1,)

    # xgrammar's own, on several thread counts: the masks one fill a row writes
    import xgrammar as xgr

    gc = GrammarCompiler(llm.tokenizer, tokenizer_size(llm.tokenizer), llm.eos_token_ids)
    params = [StructuredOutputsParams(json=SCHEMAS[i % 2]) for i in range(6)] + \
        [StructuredOutputsParams(regex="[0-9]{2,5}"), StructuredOutputsParams(choice=["yes", "no"])]
    matchers = [gc.matcher(p, 64).matcher for p in params]  # xgrammar's own
    for step in range(3):  # walk each matcher along the first token its mask allows
        want = xgr.allocate_token_bitmask(len(matchers), gc.num_tokens)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(want, i)
        real = FillThreads(xgr, cores=8)
        for threads in real.counts:
            got = torch.zeros_like(want)
            real._matchers[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
            real.choose = lambda rows, t=threads: t
            real.fill(matchers, got, list(range(len(matchers))))
            assert torch.equal(got, want), (step, threads)
        for i, m in enumerate(matchers):
            allowed = [t for t in range(gc.num_tokens) if (int(want[i, t // 32]) >> (t % 32)) & 1]
            assert m.accept_token(allowed[step % len(allowed)])


def test_the_masks_host_buffers_take_writes_in_and_out_of_inference_mode(qwen2_vl_dir):
    """On CUDA the mask's pinned buffers are made by whichever step masks first: a plain step
    under inference mode (the draft bypassed) made inference tensors, and the next verification,
    outside it, failed writing them ("Inplace update to inference tensor outside InferenceMode")."""
    import torch

    from docproc.engine.structured import GrammarCompiler, tokenizer_size
    from docproc.models.processor import load_tokenizer

    tok = load_tokenizer(qwen2_vl_dir)
    gc = GrammarCompiler(tok, tokenizer_size(tok), set())
    with torch.inference_mode():
        mask, tail = gc._host_buffers(4, pin=False)
    mask[1] = -1  # outside inference mode, as a verification writes them
    tail.fill_(0)
    with torch.inference_mode():
        tail[2] = 1
    assert int(tail[2]) == 1 and int(mask[1, 0]) == -1
