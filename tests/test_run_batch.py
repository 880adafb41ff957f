"""docproc run-batch: OpenAI batch files through the engine (CPU, the tiny fixture model)."""
from __future__ import annotations

import base64
import collections
import fcntl
import io
import json
import os
import signal
import subprocess
import struct
import sys
import zlib
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from docproc import LLM, SamplingParams
from docproc.cli import app
from docproc.openai_compat.protocol import Limits, RequestError, parse
from docproc.pipeline.settings import bundled_model

ROOT = Path(__file__).resolve().parent.parent
MODEL = bundled_model("target")  # (a chat template: the tests' tiny models have none)


def png(seed: int, w: int = 120, h: int = 90) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def chat(cid: str, content, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "anything", "messages": [{"role": "user", "content": content}], **body}}


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def keys(path: Path) -> list:
    return [r["custom_id"] if r["custom_id"] is not None else ("line", r["error"]["line"]) for r in records(path)]


def run(*args):
    return CliRunner().invoke(app, ["run-batch", *map(str, args)], catch_exceptions=False)


def test_good_and_bad_lines_each_get_one_line(tmp_path):
    """Answers for a chat with an image (data: URL), a completion and a JSON-schema answer; an
    error line for each bad one (not JSON, unknown url, a file outside the image root, a negative
    max_tokens, a broken image, a schema that does not compile); a repeated custom_id skipped."""
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"kind": {"enum": ["invoice", "receipt"]}}, "required": ["kind"],
              "additionalProperties": False}
    lines = [
        chat("img", [{"type": "image_url", "image_url": {"url": data_url(png(1))}},
                     {"type": "text", "text": "What is the total?"}], max_tokens=8, temperature=0),
        {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Invoice total:", "max_tokens": 6, "temperature": 0}},
        "{not json",
        {"custom_id": "url", "method": "POST", "url": "/v1/embeddings", "body": {}},
        chat("passwd", [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]),
        chat("neg", "hi", max_tokens=-1),
        chat("broken", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]),
        chat("json", "Return JSON", max_tokens=40, temperature=0,
             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
        chat("badschema", "hi", response_format={"type": "json_schema", "json_schema": {
            "schema": {"type": "integer", "minimum": 0.5, "exclusiveMaximum": 0.5}}}),
        chat("img", "a repeated custom_id"),
        chat("deep", "hi", guided_json="[" * 100_000),  # (it ended the whole batch: internal error)
    ]
    out = tmp_path / "out.jsonl"
    res = run("-i", write(tmp_path / "in.jsonl", lines), "-o", out, "--model", MODEL, "--device", "cpu",
              "--image-root", tmp_path)
    assert res.exit_code == 1, res.output
    assert "answered 3, errors 7" in res.output and "duplicate custom_ids skipped 1" in res.output
    recs = {r["custom_id"] if r["custom_id"] else "line3": r for r in records(out)}
    assert sorted(recs) == sorted(["img", "cmpl", "line3", "url", "passwd", "neg", "broken", "json", "badschema",
                                   "deep"])
    for cid in ("img", "cmpl", "json"):
        resp = recs[cid]["response"]
        assert resp["status_code"] == 200 and recs[cid]["error"] is None
        assert resp["body"]["usage"]["completion_tokens"] > 0
    assert recs["img"]["response"]["body"]["object"] == "chat.completion"
    assert recs["cmpl"]["response"]["body"]["object"] == "text_completion"
    assert json.loads(recs["json"]["response"]["body"]["choices"][0]["message"]["content"])["kind"] in (
        "invoice", "receipt")
    assert recs["line3"]["error"]["line"] == 3 and recs["line3"]["response"] is None
    for cid, words in (("url", "not served"), ("passwd", "outside --image-root"), ("neg", "max_tokens"),
                       ("broken", "not an image"), ("badschema", "does not compile"),
                       ("deep", "deeper than it can be read")):
        resp = recs[cid]["response"]
        assert resp["status_code"] == 400 and words in resp["body"]["error"]["message"], (cid, resp)


def test_a_chat_answer_is_the_engines_for_the_same_messages(tmp_path):
    """Greedy: the batch's text equals LLM.chat's for the same messages (the model's chat
    template), with an image as a data: URL; --batch-invariant reaches the engine."""
    content = [{"type": "text", "text": "Invoice number?"}, {"type": "image_url", "image_url": {"url": data_url(png(5))}}]
    out = tmp_path / "out.jsonl"
    assert run("-i", write(tmp_path / "in.jsonl", [chat("x", content, max_tokens=10, temperature=0)]), "-o", out,
               "--model", MODEL, "--device", "cpu", "--batch-invariant").exit_code == 0
    text = records(out)[0]["response"]["body"]["choices"][0]["message"]["content"]
    want = LLM(str(MODEL), device="cpu", batch_invariant=True).chat([{"role": "user", "content": content}],
                                                                   SamplingParams(max_tokens=10))
    assert text == want[0].outputs[0].text


def test_a_cut_off_output_is_resumed_with_each_custom_id_once(tmp_path):
    lines = [chat(f"q{i}", f"question {i}", max_tokens=4, temperature=0) for i in range(6)]
    lines.append(chat("q0", "a repeated custom_id"))  # (skipped each run, never counted done)
    src, out = write(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run("-i", src, "-o", out, "--model", MODEL, "--device", "cpu").exit_code == 0
    whole = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in records(out)}
    text = out.read_text()
    cut = len("".join(text.splitlines(keepends=True)[:2])) + 17  # two whole lines and a piece of the third
    out.write_text(text[:cut])
    # the rerun reads its input from standard input (`-i -`), the next from a pipe by name (a FIFO)
    res = CliRunner().invoke(app, ["run-batch", "-i", "-", "-o", str(out), "--model", str(MODEL), "--device", "cpu"],
                             input=src.read_bytes(), catch_exceptions=False)
    assert res.exit_code == 0 and "answered 4" in res.output and "already done 2" in res.output, res.output
    assert "duplicate custom_ids skipped 1" in res.output, res.output
    assert sorted(keys(out)) == sorted(whole)
    assert {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in records(out)} == whole
    out.write_text(text[:cut])
    fifo = tmp_path / "requests.fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"cat '{src}' > '{fifo}'"])
    res = run("-i", fifo, "-o", out, "--model", MODEL, "--device", "cpu")
    writer.wait(timeout=60)
    assert res.exit_code == 0 and "answered 4" in res.output, res.output
    assert {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in records(out)} == whole
    with open(out, "rb") as own:  # its own output on standard input (read as lines are appended: endless)
        proc = subprocess.run([sys.executable, "-m", "docproc", "run-batch", "-i", "-", "-o", str(out)], stdin=own,
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == "usage: --output is the --input file: results go to a file " \
                                                   "of their own\n"
    with open(tmp_path / "w", "wb") as w:  # standard input closed, or open for writing only (`<&-`, `0>w`)
        for name, stdin, said in (("/dev/fd/0", subprocess.DEVNULL, None), ("-", w, "is open for writing only")):
            proc = subprocess.run([sys.executable, "-c", "import os, sys; from docproc.cli import entry; "
                                   + ("os.close(0); " if said is None else "") + "sys.argv[0] = 'docproc'; entry()",
                                   "run-batch", "-i", name, "-o", str(tmp_path / "x.jsonl")], stdin=stdin,
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2 and proc.stderr == f"usage: --input {name}: standard input " \
                                                           f"{said or 'is closed'}\n", proc.stderr
    res = run("-i", src, "-o", "-")
    assert res.exit_code == 2 and "--output - is not served: results go to a file" in res.output
    res = run("-i", tmp_path, "-o", out)
    assert res.exit_code == 2 and f"--input {tmp_path} is a folder: name the batch file (or - for standard " \
                                  f"input)" in res.output


@pytest.mark.slow
def test_kill_9_mid_batch_then_rerun_holds_every_custom_id_exactly_once(tmp_path):
    lines = [chat(f"q{i}", f"question {i} " * 3, max_tokens=48, temperature=0) for i in range(600)]
    lines.insert(7, "garbage")
    src, out = write(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "docproc", "run-batch", "-i", str(src), "-o", str(out), "--model", str(MODEL),
           "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while time.time() - t0 < 120 and (not out.exists() or out.read_text().count("\n") < 40):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = out.read_text().count("\n")
    assert 0 < partial < 601, partial  # killed mid-way
    # (exit 0 or 1: the garbage line's error line may have been written before the kill)
    assert subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=600).returncode in (0, 1)
    counts = collections.Counter(keys(out))
    assert len(counts) == 601 and set(counts.values()) == {1}


def test_a_second_run_on_the_same_output_exits_75(tmp_path):
    out = tmp_path / "out.jsonl"
    fd = os.open(str(out) + ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        res = run("-i", write(tmp_path / "in.jsonl", [chat("a", "hi")]), "-o", out, "--model", MODEL,
                  "--device", "cpu")
    finally:
        os.close(fd)
    assert res.exit_code == 75 and "holds" in res.output
    # the lock is the file's, whatever link names it
    from docproc.openai_compat.batch import OutputFile
    from docproc.pipeline.runstore import LockedError

    (tmp_path / "link.jsonl").symlink_to(out)
    held = OutputFile(out)
    held.open()
    try:
        with pytest.raises(LockedError):
            OutputFile(tmp_path / "link.jsonl").open()
    finally:
        held.close()


def test_a_line_over_the_limit_is_an_error_line_never_held_whole(tmp_path, monkeypatch):
    import docproc.openai_compat.batch as batch

    monkeypatch.setattr(batch, "MAX_LINE_BYTES", 100)
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"custom_id": "a"}\n{"custom_id": "b", "x": "' + b"y" * 300 + b'"}\n\n{"custom_id": "c"}\n'
                     + b'{"x": "' + b"y" * 300 + b'", "custom_id": "d"}\n' + b"z" * 250)
    # the long line's custom_id where it comes first (its error line is keyed by it), else none
    assert [(n, cid, problem) for n, cid, _, _, problem in batch.read_lines(path)] == [
        (1, "a", None), (2, "b", "line 2 is over 0 MiB"), (4, "c", None), (5, None, "line 5 is over 0 MiB"),
        (6, None, "line 6 is over 0 MiB")]
    # JSON's whitespace only (a vertical tab is not), a byte-order mark allowed, escapes read
    assert [batch._leading_custom_id(h) for h in (b'\x0b{"custom_id": "x"', b'\xef\xbb\xbf {"custom_id": "x"',
                                                   b'{"custom_id": "a\\"b"', b'{"custom_id": ""')] == \
        [None, "x", 'a"b', None]


def test_images_and_pdfs_from_the_image_root_only(tmp_path):
    """A local image or PDF under --image-root is read (a PDF's pages as images, in order); a path
    out of it (.., a link that leads out, an absolute path elsewhere) and any network URL are
    refused, naming the part."""
    import pymupdf as fitz

    root = tmp_path / "root"
    root.mkdir()
    (root / "page.png").write_bytes(png(3))
    doc = fitz.open()
    for _ in range(3):
        doc.new_page(width=200, height=260)
    pdf = doc.tobytes()
    (root / "doc.pdf").write_bytes(pdf)
    (tmp_path / "secret.png").write_bytes(png(4))
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    limits = Limits(image_root=root)
    url = "/v1/chat/completions"

    def render(messages):  # (the messages the engine's chat template would get)
        return messages

    def body(*parts):
        return {"messages": [{"role": "user", "content": list(parts)}]}
    p = parse(url, body({"type": "image_url", "image_url": {"url": "page.png"}},
                        {"type": "file", "file": {"file_data": data_url(pdf, "application/pdf")}},
                        {"type": "file", "file": {"file_data": f"file://{root / 'doc.pdf'}"}}), limits, render)
    images = [part["image"] for part in p.prompt[0]["content"]]
    assert len(images) == 7 and images[0] == png(3) and [im.size for im in images[1:]] == [(334, 434)] * 6
    wrapped = data_url(pdf, "application/pdf")  # base64 in MIME's 76-column lines
    head, b64 = wrapped.split(",", 1)
    wrapped = head + "," + "\r\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))
    p = parse(url, body({"type": "file", "file": {"file_data": wrapped}}), limits, render)
    assert [part["image"].size for part in p.prompt[0]["content"]] == [(334, 434)] * 3
    for bad, words in (("../secret.png", "outside --image-root"), ("link.png", "outside --image-root"),
                       (str(tmp_path / "secret.png"), "outside --image-root"),
                       ("https://example.com/a.png", "fetches nothing"), ("missing.png", "does not exist"),
                       ("ftp://x/y", "fetches nothing"), ("page\0.png", "NUL"), ("file:///x%00y", "NUL"),
                       # whether a file outside the root exists is not told
                       ("/nonexistent/x.png", "outside --image-root"), ("../missing.png", "outside --image-root")):
        with pytest.raises(RequestError, match=words):
            parse(url, body({"type": "image_url", "image_url": {"url": bad}}), limits, render)
    # a header claiming 100000 x 100000 pixels (Pillow's bomb guard refuses to open it): its size, not "not an image"
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    bomb = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))
    with pytest.raises(RequestError, match=r"10000000000 pixels, more than 40000000"):
        parse(url, body({"type": "image_url", "image_url": {"url": data_url(bomb, "image/png")}}), limits, render)
    with pytest.raises(RequestError, match=r"a PDF, not an image: send it as a file part"):
        parse(url, body({"type": "image_url", "image_url": {"url": data_url(pdf, "image/png")}}), limits, render)
    with pytest.raises(RequestError, match="not a readable PDF"):
        parse(url, body({"type": "file", "file": {"file_data": data_url(b"%PDF-1.7 nonsense", "application/pdf")}}),
              limits, render)
    with pytest.raises(RequestError, match="stream is not supported"):
        parse(url, {**body({"type": "text", "text": "x"}), "stream": True}, limits, render)
    for role in (["user"], {"a": 1}, None, 3):  # (a list or dict is not hashable: no TypeError)
        with pytest.raises(RequestError, match=r"messages\[0\] must be an object with a role"):
            parse(url, {"messages": [{"role": role, "content": "x"}]}, limits, render)
    with pytest.raises(RequestError, match="stream_options is only for stream: true"):
        parse(url, {**body({"type": "text", "text": "x"}), "stream_options": {"include_usage": True}}, limits, render,
              streaming=True)
    # a batch line's stream_options are ignored (it never streams); top_k 0 is off, as in vLLM
    p = parse(url, {**body({"type": "text", "text": "x"}), "stream_options": {"include_usage": True}, "top_k": 0},
              limits, render)
    assert not p.include_usage and p.params.top_k == -1


def test_hostile_lines_and_output_files(tmp_path):
    """Lines that once crashed or misled the batch: JSON nested 2,000 deep, a lone surrogate in a
    custom_id and in a prompt, a custom_id spelled like a line key, an image header of 13,000 x
    13,000 pixels, n past 128, max_completion_tokens null beside max_tokens: each its own line.
    An output file that holds other text is refused untouched (exit 2); a blank line inside a
    results file keeps every result after it."""
    big = io.BytesIO()
    Image.new("1", (13000, 13000)).save(big, "PNG")
    lines = [
        "[" * 2000 + "]" * 2000,
        '{"custom_id": "sur\\ud800", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}',
        '{"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\\ud800 hello"}}',
        {"custom_id": "#line 1", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Total:", "max_tokens": 2, "temperature": 0}},
        chat("bomb", [{"type": "image_url", "image_url": {"url": data_url(big.getvalue())}}]),
        chat("many", "hi", n=1000),
        chat("tokens", "hi", max_tokens=3, max_completion_tokens=None, temperature=0, ignore=None),
    ]
    src, out = write(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    res = run("-i", src, "-o", out, "--model", MODEL, "--device", "cpu")
    assert res.exit_code == 1, res.output
    recs = records(out)
    assert sorted(keys(out), key=str) == sorted([("line", 1), ("line", 2), ("line", 3), "#line 1", "bomb", "many",
                                                 "tokens"], key=str)
    by = {r["custom_id"]: r for r in recs if r["custom_id"]}
    assert by["#line 1"]["response"]["status_code"] == 200
    assert "13000x13000 pixels" in by["bomb"]["response"]["body"]["error"]["message"]
    assert "n must be at most 128" in by["many"]["response"]["body"]["error"]["message"]
    assert by["tokens"]["response"]["body"]["usage"]["completion_tokens"] <= 3
    # a blank line in the results: nothing after it is lost
    text = out.read_text().splitlines(keepends=True)
    out.write_text("".join(text[:2] + ["\n"] + text[2:]))
    res = run("-i", src, "-o", out, "--model", MODEL, "--device", "cpu")
    assert "already done 7" in res.output and "answered 0" in res.output, res.output
    notes = tmp_path / "notes.md"
    notes.write_text("# my notes\nnot results\n")
    res = run("-i", src, "-o", notes, "--model", MODEL, "--device", "cpu")
    assert res.exit_code == 2 and "not a run-batch result" in res.output
    assert notes.read_text() == "# my notes\nnot results\n"
    os.link(src, tmp_path / "hard.jsonl")
    assert run("-i", src, "-o", tmp_path / "hard.jsonl", "--model", MODEL, "--device", "cpu").exit_code == 2


def test_a_batch_whose_model_cannot_load_leaves_no_empty_output(tmp_path):
    """A run refused at load (exit 3) leaves no output file it made (an empty one reads as a batch
    that answered nothing); an output that was there stays as it was."""
    src = write(tmp_path / "in.jsonl", [chat("a", "hi", max_tokens=2)])
    new, old = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    assert run("-i", src, "-o", new, "--model", tmp_path / "missing", "--device", "cpu").exit_code == 3
    assert not new.exists()
    line = json.dumps({"custom_id": "z", "response": {"status_code": 200}}) + "\n"
    old.write_text(line)
    assert run("-i", src, "-o", old, "--model", tmp_path / "missing", "--device", "cpu").exit_code == 3
    assert old.read_text() == line
    link = tmp_path / "link.jsonl"  # a link to a file not there yet: the link stays, no empty target
    link.symlink_to(tmp_path / "target.jsonl")
    assert run("-i", src, "-o", link, "--model", tmp_path / "missing", "--device", "cpu").exit_code == 3
    assert link.is_symlink() and not (tmp_path / "target.jsonl").exists()
