"""docproc serve: a real server process (CPU, the bundled model) answering the `openai` client."""
from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from docproc import LLM, SamplingParams  # noqa: E402
from docproc.pipeline.settings import bundled_model  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = bundled_model("target")
KEY = "sk-test-key"


def png(seed: int, w: int = 112, h: int = 84) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def start(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """A `docproc serve --port 0` process and its base URL (read from its first line)."""
    proc = subprocess.Popen([sys.executable, "-m", "docproc", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200", **(env or {})})
    line = proc.stdout.readline()
    m = re.search(r"http://[\d.]+:\d+", line)
    if m is None:
        proc.kill()
        raise AssertionError(f"no address in {line!r}: {proc.stderr.read()}")
    return proc, m.group(0)


@pytest.fixture(scope="module")
def server():
    proc, base = start("--api-key", KEY)
    yield proc, base
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    return LLM(str(MODEL), device="cpu")


def messages(seed: int, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(seed))}},
                                         {"type": "text", "text": question}]}]


def post(base: str, path: str, body: bytes | str, key: str | None = KEY, method: str = "POST") -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=body.encode() if isinstance(body, str) else body, method=method,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(base: str, name: str) -> float:
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_chat_answers_equal_the_engine_alone_and_among_16_concurrent(client, reference):
    """Greedy chat completions with an image as a data: URL: the text equals LLM.chat's for the
    same messages, for one request and for each of 16 sent at once (different pages and
    questions; two of them the same page, which the engine encodes once)."""
    questions = ["What is the total?", "Who is the vendor?", "What is the invoice number?", "Which currency?"]
    convs = [messages(i % 15, questions[i % 4]) for i in range(16)]
    expected = [o.outputs[0].text for o in reference.chat(convs, SamplingParams(temperature=0, max_tokens=12))]

    one = client.chat.completions.create(model="whatever", messages=convs[0], max_tokens=12, temperature=0)
    assert one.choices[0].message.content == expected[0]
    assert one.object == "chat.completion" and one.usage.completion_tokens > 0

    def ask(conv):
        r = client.chat.completions.create(model="target", messages=conv, max_tokens=12, temperature=0)
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, convs))
    assert got == expected


def test_streaming_yields_the_same_text_in_chunks(client):
    kw = dict(model="target", messages=messages(3, "Describe the page."), max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(texts) == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    # completions too, with a stop string: the streamed text ends where the whole one does
    cw = client.completions.create(model="target", prompt="Invoice number:", max_tokens=30, temperature=0)
    stop = cw.choices[0].text[4:6]
    cw = client.completions.create(model="target", prompt="Invoice number:", max_tokens=30, temperature=0, stop=[stop])
    parts = [c.choices[0].text for c in client.completions.create(model="target", prompt="Invoice number:",
                                                                    max_tokens=30, temperature=0, stop=[stop],
                                                                    stream=True)]
    assert "".join(parts) == cw.choices[0].text and stop not in cw.choices[0].text
    # it comes in pieces (a few steps' tokens at a time when the client or the loop is slower
    # than the engine: over 200 tokens, never all at once)
    parts = [c.choices[0].text for c in client.completions.create(model="target", prompt="Invoice", max_tokens=200,
                                                                    temperature=0, stream=True,
                                                                    extra_body={"ignore_eos": True})]
    assert sum(1 for t in parts if t) >= 2


def test_n_choices_stream_each_to_its_stop_string(server, client):
    """n sampled choices with a seed and a stop string: each choice's streamed text is its whole
    answer's, and none holds the stop string (a choice that stopped sent its last tokens, the
    stop string among them, before the request ended); greedy n streams every choice."""
    kw = dict(model="target", prompt="Invoice number:", max_tokens=30, temperature=1.0, seed=11, n=3)
    first = client.completions.create(**kw)
    stop = first.choices[0].text[3:5]
    whole = {c.index: c.text for c in client.completions.create(**kw, stop=[stop]).choices}
    assert whole[0] == first.choices[0].text[:3]
    streamed = {i: "" for i in range(3)}
    for c in client.completions.create(**kw, stop=[stop], stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert streamed == whole and not any(stop in t for t in streamed.values())
    greedy = {i: "" for i in range(2)}
    for c in client.completions.create(model="target", prompt="Total:", max_tokens=12, temperature=0, n=2,
                                       stream=True):
        for ch in c.choices:
            greedy[ch.index] += ch.text
    assert greedy[0] == greedy[1] != ""
    # /metrics counts the tokens the engine generated: greedy choices are one run, repeated
    before = metric(server[1], "docproc_generation_tokens_total")
    client.completions.create(model="target", prompt="Total:", max_tokens=5, temperature=0, n=4,
                              extra_body={"ignore_eos": True})
    assert metric(server[1], "docproc_generation_tokens_total") == before + 5


def test_a_pdf_part_is_rendered_into_its_pages(client, reference):
    """A PDF part (rendered in the server's worker processes): its pages are the images, and
    the answer is the engine's for those pages."""
    fitz = pytest.importorskip("pymupdf")
    doc = fitz.open()
    for i in range(2):
        doc.new_page(width=100, height=80).insert_text((10, 40), f"Invoice {i}")
    pdf = doc.tobytes()
    part = {"type": "file", "file": {"file_data": "data:application/pdf;base64," + base64.b64encode(pdf).decode()}}
    r = client.chat.completions.create(model="target", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": [part, {"type": "text", "text": "Which invoices?"}]}])
    pages = []
    for page in fitz.open(stream=pdf, filetype="pdf"):
        pix = page.get_pixmap(dpi=120, alpha=False)
        pages.append(Image.frombytes("RGB", (pix.width, pix.height), pix.samples))
    expected = reference.chat([[{"role": "user", "content": [{"type": "image", "image": p} for p in pages] + [
        {"type": "text", "text": "Which invoices?"}]}]], SamplingParams(temperature=0, max_tokens=8))[0]
    assert r.choices[0].message.content == expected.outputs[0].text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    # the same PDF as bare base64, without the data: URL around it (it was read as a file name)
    part["file"]["file_data"] = base64.b64encode(pdf).decode()
    bare = client.chat.completions.create(model="target", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": [part, {"type": "text", "text": "Which invoices?"}]}])
    assert bare.choices[0].message.content == r.choices[0].message.content


def test_a_slow_constraint_compiles_beside_the_engine(server, client):
    """A constraint that takes xgrammar a second or more to compile (eight patterns with long
    repetitions, the most a schema may hold) holds up only its own request: one sent after it, of
    16 tokens, is answered before the constrained one's single token (a compile in the engine's
    thread would hold the engine: both would then run together and the one token come first)."""
    pytest.importorskip("xgrammar")
    done = []
    slow = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^%s{1,990}$" % chr(97 + i)}
                                             for i in range(8)}}

    def constrained():
        client.chat.completions.create(model="target", messages=[{"role": "user", "content": "code?"}], max_tokens=1,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "c", "schema": slow}})
        done.append("constrained")

    t = threading.Thread(target=constrained)
    t.start()
    time.sleep(0.3)
    client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                                   extra_body={"ignore_eos": True})
    done.append("plain")
    t.join(120)
    assert done == ["plain", "constrained"]


def test_json_schema_answers_parse_and_match(client):
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"total": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]}},
              "required": ["total", "currency"], "additionalProperties": False}
    for seed in range(3):
        r = client.chat.completions.create(
            model="target", messages=messages(seed, "Total and currency as JSON."), max_tokens=60, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_vllms_guided_fields_constrain_the_answer(client):
    """guided_choice / guided_regex / guided_json and structured_outputs (vLLM's fields, which
    its clients send through extra_body) constrain the answer as response_format does (they were
    ignored: the answer came back free)."""
    pytest.importorskip("xgrammar")
    ask = dict(model="target", messages=[{"role": "user", "content": "Paid?"}], max_tokens=32, temperature=0)
    for extra, ok in (({"guided_choice": ["paid", "unpaid"]}, lambda t: t in ("paid", "unpaid")),
                      ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: re.fullmatch("[0-9]{3}", t)),
                      ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
                      ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                        "additionalProperties": False}},
                       lambda t: isinstance(json.loads(t)["n"], int))):
        r = client.chat.completions.create(**ask, extra_body=extra)
        # (an answer the budget closed at max_tokens is still whole: length, valid)
        assert r.choices[0].finish_reason in ("stop", "length") and ok(r.choices[0].message.content), (extra, r)


def test_a_request_whose_client_left_before_it_entered_the_engine_counts_as_aborted():
    """A stream's client that leaves while its request still waits in the loop's queue (its
    submit and cancel taken in one batch, the engine busy with a step): /metrics counts it under
    finish_reason "abort", as one cancelled inside the engine is (it was counted nowhere)."""
    import asyncio

    from docproc.openai_compat.protocol import COMPLETIONS, Parsed
    from docproc.openai_compat.server import EngineLoop, Job

    eng = EngineLoop(LLM(str(bundled_model("target")), device="cpu"))
    loop = asyncio.new_event_loop()
    try:
        job = Job(Parsed(COMPLETIONS, "Invoice number:", SamplingParams(max_tokens=4, n=2, temperature=1.0), None),
                  loop, asyncio.Queue())
        eng.queued += 1  # (admitted)
        eng._inbox.put(("submit", job))
        eng._inbox.put(("cancel", job))
        eng.start()
        eng.stop(timeout=60)
    finally:
        loop.close()
    assert eng.finished == {"abort": 2} and eng.queued == 0 and eng.running == 0


def test_malformed_requests_get_4xx_and_the_server_goes_on(server, client):
    base = server[1]
    good = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ("/v1/chat/completions", "{not json", 400),
        ("/v1/chat/completions", json.dumps({**good, "messages": "hi"}), 400),
        ("/v1/chat/completions", json.dumps({**good, "messages": [{"role": "wizard", "content": "x"}]}), 400),
        ("/v1/chat/completions", json.dumps({**good, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}), 400),
        ("/v1/chat/completions", json.dumps({**good, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}), 400),
        ("/v1/chat/completions", json.dumps({**good, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}), 400),
        ("/v1/chat/completions", json.dumps({**good, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}), 400),
        # a $ref to another document (nothing is fetched: it was decoded unconstrained); strict
        # with a keyword decoding cannot hold (it answered a non-multiple, finish_reason stop)
        ("/v1/chat/completions", json.dumps({**good, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/s.json"}}}}),
         400),
        ("/v1/chat/completions", json.dumps({**good, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"type": "integer", "multipleOf": 7, "minimum": 0}}}}), 400),
        # a file part that is not a PDF (MuPDF opened a PNG, an SVG or an HTML page as one)
        ("/v1/chat/completions", json.dumps({**good, "messages": [{"role": "user", "content": [
            {"type": "file", "file": {"file_data": "data:application/pdf;base64," + base64.b64encode(
                b"<svg xmlns='http://www.w3.org/2000/svg'/>").decode()}}]}]}), 400),
        # the completions API's logprobs 0 asks for the chosen tokens' logprobs (it answered null)
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2, "logprobs": 0}), 400),
        ("/v1/chat/completions", json.dumps({**good, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file://evil.example/etc/a.png"}}]}]}), 400),
        ("/v1/chat/completions", json.dumps({**good, "guided_json": {"$ref": "https://example.com/s.json"}}), 400),
        ("/v1/chat/completions", json.dumps({**good, "guided_regex": "a+", "guided_choice": ["b"]}), 400),
        ("/v1/chat/completions", json.dumps({**good, "guided_json": "[" * 100_000}), 400),  # (a 500 before)
        ("/v1/chat/completions", json.dumps({**good, "structured_outputs": {"structural_tag": {"x": 1}}}), 400),
        # a repetition xgrammar would take a minute to build, holding the compile threads
        ("/v1/chat/completions", json.dumps({**good, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "^[a-z]{1,20000}$"}}}}), 400),
        # no finite answer: decoding under it grew the server's memory until the system killed it
        ("/v1/chat/completions", json.dumps({**good, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}}}}),
         400),
        ("/v1/chat/completions", json.dumps({**good, "max_tokens": -5}), 400),
        ("/v1/chat/completions", json.dumps({**good, "temperature": "hot"}), 400),
        ("/v1/chat/completions", json.dumps({**good, "tools": [{"type": "function"}]}), 400),
        ("/v1/chat/completions", json.dumps({**good, "messages": [{"role": "user", "content": "x" * 100_000}]}), 400),
        ("/v1/chat/completions", '"\\ud800"', 400),
        ("/v1/chat/completions", "[" * 100_000, 400),
        ("/v1/completions", json.dumps({"prompt": ""}), 400),
        ("/v1/embeddings", json.dumps(good), 404),
        ("/v1/chat/completions", json.dumps({**good, "messages": [{"role": ["user"], "content": "x"}]}), 400),
        ("/v1/chat/completions", json.dumps({**good, "stream_options": {"include_usage": True}}), 400),
        ("/v1/chat/completions", json.dumps({**good, "stream": True, "stream_options": {"include_usage": "yes"}}),
         400),
        # too long for the model: refused before a stream starts (not a 200 with an error event)
        ("/v1/chat/completions", json.dumps({**good, "stream": True,
                                             "messages": [{"role": "user", "content": "x" * 100_000}]}), 400),
        ("/v1/chat/completions", json.dumps({**good, "temperature": 1e300}), 400),
        # a truncated QOI image: Pillow's plugin raises ValueError, not OSError
        ("/v1/chat/completions", json.dumps({**good, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,cW9pZgAAAEAAAABAAwGpiP39/f0="}}]}]}),
         400),
        ("/v1/chat/completions", json.dumps({**good, "stop": [f"s{i}" for i in range(17)]}), 400),
        # far longer than the model takes: refused before it is tokenized whole
        ("/v1/chat/completions", json.dumps({**good, "messages": [{"role": "user", "content": "word7 " * 200_000}]}),
         400),
        ("/v1/chat/completions", "[" * 10 + "{}," * 100_001 + "{}" + "]" * 10, 400),
    ]
    for path, body, status in cases:
        code, err = post(base, path, body)
        assert code == status, (path, body[:80], code, err)
        assert err["error"]["message"] and err["error"]["code"] == status
    from docproc.openai_compat.server import carries_images, containers

    # a body without images or files is parsed in threads of its own (never behind decoding pages)
    assert not carries_images(json.dumps(good).encode()) and carries_images(json.dumps({**good, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode())

    assert containers(json.dumps({"a": '{"[\\', "b": [1, {}], "c": "\\", "d": ["]"]}).encode()) == 4
    # brackets inside a string are text, not containers (refused for its length, not as JSON)
    code, err = post(base, "/v1/chat/completions", json.dumps({**good, "messages": [
        {"role": "user", "content": "{" * 100_001}]}))
    assert code == 400 and "JSON objects" not in err["error"]["message"], err
    code, err = post(base, "/v1/chat/completions", "[" * 5000 + "]" * 5000)
    assert code == 400 and "deeper than it can be read" in err["error"]["message"], err
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:  # 413 from the header, before the body
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {40 << 20}\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    assert post(base, "/v1/chat/completions", json.dumps(good), key="wrong")[0] == 401
    assert post(base, "/v1/chat/completions", json.dumps(good), key=None)[0] == 401
    assert post(base, "/v1/completions", "", method="GET")[0] == 405
    assert post(base, "/v1/models/", "", method="GET")[0] == 404  # not a redirect
    with socket.create_connection((host, int(port)), timeout=30) as s:  # a client gone mid-body: not a 500
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"prompt\"".encode())
    deadline = time.time() + 30
    while metric(base, 'docproc_http_requests_total{path="/v1/completions",status="499"}') < 1:
        assert time.time() < deadline
        time.sleep(0.1)
    assert urllib.request.urlopen(base + "/health", timeout=10).read() == b"ok\n"
    r = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].message.content is not None
    assert metric(base, 'docproc_http_requests_total{path="/v1/chat/completions",status="400"}') >= 22
    assert not re.search(r'status="5\d\d"', urllib.request.urlopen(base + "/metrics", timeout=10).read().decode())
    # a temperature float32 holds as 0 decodes greedily (not inf and nan: garbage tokens)
    kw = dict(model="target", messages=[{"role": "user", "content": "Total?"}], max_tokens=8)
    assert (client.chat.completions.create(**kw, temperature=1e-300).choices[0].message.content
            == client.chat.completions.create(**kw, temperature=0).choices[0].message.content)


def test_a_client_that_goes_away_cancels_its_request(server, client):
    base = server[1]
    before = metric(base, 'docproc_request_finished_total{finish_reason="abort"}')
    stream = client.completions.create(model="target", prompt="Invoice", max_tokens=4000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    # and one that waits for a whole answer, timed out by its client
    slow = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        slow.completions.create(model="target", prompt="Total", max_tokens=4000, extra_body={"ignore_eos": True})
    deadline = time.time() + 30
    while time.time() < deadline and metric(base, 'docproc_request_finished_total{finish_reason="abort"}') < before + 2:
        time.sleep(0.2)
    assert metric(base, 'docproc_request_finished_total{finish_reason="abort"}') == before + 2
    assert metric(base, "docproc_requests_running") == 0
    assert metric(base, "docproc_generation_tokens_total") < 6000  # neither ran to its 4,000 tokens


def test_a_stream_interval_sends_the_first_token_at_once_then_fewer_chunks():
    """--stream-interval-ms: a stream's first token comes in its own chunk at once, the rest
    together with the output when the interval is longer than the answer; the text is the same."""
    proc, base = start("--stream-interval-ms", "10000")
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        kw = dict(model="target", prompt="Invoice", max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
        whole = c.completions.create(**kw).choices[0].text
        texts = [ch.choices[0].text for ch in c.completions.create(**kw, stream=True) if ch.choices]
        assert "".join(texts) == whole
        assert len([t for t in texts if t]) == 2, texts
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_sigterm_lets_the_request_in_flight_finish(tmp_path):
    """SIGTERM: the request being answered finishes (200, all its tokens), a client still
    sending its body gets 503 (rather than holding the server open), the server exits 0."""
    proc, base = start()
    try:
        blocked = socket.socket()
        host, port = base.removeprefix("http://").split(":")
        half = socket.create_connection((host, int(port)), timeout=60)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\"")
        got = {}

        def ask():
            got["r"] = post(base, "/v1/completions", json.dumps({"prompt": "Invoice", "max_tokens": 300,
                                                                  "ignore_eos": True, "temperature": 0}), key=None)

        t = threading.Thread(target=ask)
        t.start()
        deadline = time.time() + 30
        while metric(base, "docproc_requests_running") < 1 and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert half.recv(4096).startswith(b"HTTP/1.1 503")
        t.join(120)
        assert got["r"][0] == 200 and got["r"][1]["usage"]["completion_tokens"] == 300
        assert proc.wait(60) == 0
        with pytest.raises(OSError):  # no longer listening
            blocked.connect((host, int(port)))
    finally:
        proc.kill()
        proc.wait()


def test_a_second_signal_stops_at_once():
    """Ctrl-C twice with a long whole-answer request in flight: it gets a 503 and the server
    exits without generating it to the end."""
    proc, base = start()
    try:
        got = {}

        def ask():
            got["r"] = post(base, "/v1/completions", json.dumps({"prompt": "Invoice", "max_tokens": 100_000,
                                                                  "ignore_eos": True}), key=None)

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        deadline = time.time() + 30
        while metric(base, "docproc_requests_running") < 1 and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        t.join(30)
        assert got["r"][0] == 503 and "stopping" in got["r"][1]["error"]["message"]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("args, env, words", [
    (["--host", ""], {}, "--host is empty"),
    (["--max-request-mb", "nan"], {}, "--max-request-mb must be a number from 0.01 to 1024"),
    (["--max-request-mb", "0.0000001"], {}, "--max-request-mb must be a number from 0.01 to 1024"),
    ([], {"DOCPROC_API_KEY": ""}, "the API key (--api-key or DOCPROC_API_KEY) is empty"),
    (["--api-key", "  "], {}, "the API key (--api-key or DOCPROC_API_KEY) is empty"),
    (["--stream-interval-ms", "nan"], {}, "--stream-interval-ms must be a number from 0 to 10000"),
    (["--stream-interval-ms", "-1"], {}, "--stream-interval-ms must be a number from 0 to 10000"),
])
def test_options_that_would_serve_wrongly_are_refused(args, env, words):
    r = subprocess.run([sys.executable, "-m", "docproc", "serve", "--model", "/nonexistent", *args],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200", **env})
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_a_port_in_use_stops_before_the_model_loads():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    r = subprocess.run([sys.executable, "-m", "docproc", "serve", "--port", str(taken.getsockname()[1]),
                        "--model", "/nonexistent"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot listen on" in r.stderr
    taken.close()
