"""`docproc serve` under load against the same engine's offline `LLM.generate`, in one process and
one engine: tokens/s of each, and the served requests' time to first token and time per output
token (p50/p99) as the clients saw them.

    python3 bench/serve_load.py --model bundled [--draft bundled] --json $OUT/serve_bundled.json
    python3 bench/serve_load.py --geometry 7b --load-format dummy --json $OUT/serve_7b.json

Requests: P synthetic pages (868x1092 PNGs, as data: URLs) x Q questions, chat completions of N
new tokens each (greedy, ignore_eos), the Q questions of a page sharing its image. Offline: the
prompts LLM.chat_prompt makes of those messages, all given to LLM.generate at once, and again with
at most C running at once (the clients' concurrency: the engine's max_num_seqs). Served: the
server (docproc.openai_compat.server.serve, as `docproc serve` runs it) on a local port, and C
client workers in a child process (asyncio, plain HTTP/1.1), each sending its next request when
its last one finished, streamed (time to first token: the role chunk, which comes with the first
token) or whole. Every pass has pages of its own (no pass finds another's pages in the prefix
or vision cache); the first offline pass warms the engine up (kernels, graphs) and is not counted.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is the invoice number?", "Who is the vendor?", "What is the total amount?",
             "Return every field of the document."]


def page_png(seed: int, w: int = 868, h: int = 1092) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = np.full((h, w, 3), 255, np.uint8)
    for y in range(40, h - 40, 24):  # text-like rows of dark specks
        n = int(rng.integers(20, 80))
        xs = rng.integers(40, w - 40, n)
        img[y:y + 10, :][:, xs] = rng.integers(0, 120, (10, n, 1), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "PNG")
    return buf.getvalue()


def bodies(first_seed: int, pages: int, queries: int, new_tokens: int, stream: bool) -> list[dict]:
    out = []
    for p in range(pages):
        url = "data:image/png;base64," + base64.b64encode(page_png(first_seed + p)).decode()
        for q in range(queries):
            out.append({"model": "m", "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {}),
                        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                                  {"type": "text", "text": QUESTIONS[q % 4]}]}]})
    return out


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


# ---- the client (a child process) -----------------------------------------------------------------
async def one_request(host: str, port: int, body: bytes) -> dict:
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    rec = {"status": status, "t0": t0, "first": None, "end": None, "tokens": 0}
    if headers.get("transfer-encoding") == "chunked":
        buf = b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            buf += await reader.readexactly(size)
            await reader.readexactly(2)
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ")
                now = time.perf_counter()
                if data == b"[DONE]":
                    rec["end"] = now
                    continue
                msg = json.loads(data)
                if rec["first"] is None and msg.get("choices"):
                    rec["first"] = now
                if msg.get("usage"):
                    rec["tokens"] = msg["usage"]["completion_tokens"]
    else:
        msg = json.loads(await reader.readexactly(int(headers["content-length"])))
        rec["end"] = time.perf_counter()
        rec["tokens"] = msg.get("usage", {}).get("completion_tokens", 0)
    writer.close()
    return rec


async def client_main(url: str, path: Path, clients: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    todo = [line.encode() for line in path.read_text().splitlines()]
    queue: asyncio.Queue = asyncio.Queue()
    for b in todo:
        queue.put_nowait(b)
    recs: list[dict] = []

    async def worker() -> None:
        while not queue.empty():
            recs.append(await one_request(host, int(port), queue.get_nowait()))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    ok = [r for r in recs if r["status"] == 200]
    ttft = [r["first"] - r["t0"] for r in ok if r["first"] is not None]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["first"] is not None and r["tokens"] > 1]
    latency = [r["end"] - r["t0"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(recs), "ok": len(ok), "seconds": round(wall, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "tpot_p50_ms": None if not tpot else 1000 * percentile(tpot, 0.5),
            "tpot_p99_ms": None if not tpot else 1000 * percentile(tpot, 0.99),
            "latency_p50_s": percentile(latency, 0.5), "latency_p99_s": percentile(latency, 0.99)}


# ---- the server and the offline baseline (this process) -----------------------------------------
def model_dirs(a) -> tuple[str, str | None]:
    sys.path.insert(0, str(ROOT / "tests"))
    from docproc.pipeline.settings import bundled_model

    if a.geometry is None:
        target = str(bundled_model("target")) if a.model == "bundled" else a.model
        draft = str(bundled_model("draft")) if a.draft == "bundled" else a.draft
        return target, draft
    import torch
    from fixtures.checkpoints import make_model

    work = Path(a.work)
    out = []
    for geometry, seed in ((a.geometry, 0), (a.draft_geometry, 1)):
        if geometry is None:
            out.append(None)
            continue
        folder = work / geometry
        if not (folder / "config.json").exists():
            make_model(folder, geometry=geometry, seed=seed, weights=a.load_format != "dummy", dtype=torch.bfloat16,
                       device="cuda" if torch.cuda.is_available() else "cpu")
        # the tests' tokenizer has no chat template: the bundled model's (Qwen's layout)
        shutil.copy(bundled_model("target") / "chat_template.jinja", folder / "chat_template.jinja")
        out.append(str(folder))
    return out[0], out[1]


def offline(llm, reqs: list[dict], new_tokens: int, max_seqs: int | None = None) -> dict:
    """LLM.generate over every request at once; max_seqs: at most that many running at once (the
    clients' concurrency: the engine takes the next as one finishes, as the served run does)."""
    from docproc import SamplingParams

    prompts = [llm.chat_prompt(b["messages"]) for b in reqs]
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    default = llm.scheduler.max_num_seqs
    llm.scheduler.max_num_seqs = max_seqs or default
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, sp)
    finally:
        llm.scheduler.max_num_seqs = default
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(outs), "seconds": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2)}


def served(llm, reqs: list[dict], clients: int, name: str, stream_interval: float = 0.0) -> dict:
    """One load run: the server on a free port in this (main) thread, the client a child process;
    when the child exits, SIGTERM to ourselves stops the server (it drains first)."""
    from docproc.openai_compat.protocol import Limits
    from docproc.openai_compat.server import ServerConfig, serve

    path = Path(f"/tmp/serve_load_{os.getpid()}_{name}.jsonl")
    path.write_text("".join(json.dumps(b) + "\n" for b in reqs))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    result_path = path.with_suffix(".json")
    child = subprocess.Popen([sys.executable, __file__, "--client", url, "--bodies", str(path),
                              "--clients", str(clients), "--json", str(result_path)])

    def stop_when_done() -> None:
        child.wait()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_done, daemon=True).start()
    cfg = ServerConfig("m", Limits(max_images=16), max_request_bytes=64 << 20, max_model_len=llm.max_model_len,
                       stream_interval=stream_interval)
    code = serve(llm, cfg, sock)
    res = json.loads(result_path.read_text())
    res["server_exit"] = code
    path.unlink()
    result_path.unlink()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--draft", default=None, help="a draft folder or bundled")
    ap.add_argument("--geometry", default=None, help="a random-weight target of this geometry instead of --model")
    ap.add_argument("--draft-geometry", default=None)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--work", default="/tmp/docproc-serve-bench")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--modes", default="stream,whole", help="served passes: stream, whole, or both")
    ap.add_argument("--spec-k", default="auto", help="draft tokens per step with a draft (docproc serve's default)")
    ap.add_argument("--stream-interval-ms", default=None,
                    help="docproc serve's --stream-interval-ms (its default if not given); a comma list runs a "
                    "stream pass for each (stream_<ms>ms)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the server's process (an experiment; Python's default 0.005)")
    ap.add_argument("--repeats", type=int, default=2, help="offline and served passes of each mode, alternated")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gpu-util", type=float, default=0.9)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--bodies", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.client:
        Path(a.json).write_text(json.dumps(asyncio.run(client_main(a.client, Path(a.bodies), a.clients))))
        return

    import torch

    from docproc import LLM
    from docproc.cli import STREAM_INTERVAL_MS

    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    intervals = [float(x) for x in (a.stream_interval_ms or str(STREAM_INTERVAL_MS)).split(",")]
    target, draft = model_dirs(a)
    kw = {"load_format": a.load_format} if a.geometry else {}
    if draft is not None:
        kw["num_speculative_tokens"] = a.spec_k if a.spec_k == "auto" else int(a.spec_k)
    llm = LLM(target, speculative_model=draft, device=a.device, gpu_memory_utilization=a.gpu_util, **kw)
    result = {"date": time.strftime("%Y-%m-%d"), "args": vars(a), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "passes": []}
    seed = [0]

    def fresh(stream: bool) -> list[dict]:
        seed[0] += a.pages
        return bodies(seed[0] * 1000, a.pages, a.queries, a.new_tokens, stream)

    warm = offline(llm, fresh(False), a.new_tokens)
    result["warmup"] = warm
    print(json.dumps({"warmup": warm}), flush=True)
    modes = []  # (name, streamed, interval in seconds)
    for mode in a.modes.split(","):
        if mode != "stream":
            modes.append((mode, False, 0.0))
        else:
            modes += [("stream" if len(intervals) == 1 else f"stream_{ms:g}ms", True, ms / 1000) for ms in intervals]
    for r in range(a.repeats):
        row = {"repeat": r, "offline": offline(llm, fresh(False), a.new_tokens),
               "offline_at_clients": offline(llm, fresh(False), a.new_tokens, a.clients)}
        for mode, streamed, interval in modes:
            row[mode] = served(llm, fresh(streamed), a.clients, f"{mode}{r}", interval)
            row[mode]["ratio_to_offline"] = round(row[mode]["tokens_per_s"] / row["offline"]["tokens_per_s"], 3)
            row[mode]["ratio_to_offline_at_clients"] = round(
                row[mode]["tokens_per_s"] / row["offline_at_clients"]["tokens_per_s"], 3)
        result["passes"].append(row)
        print(json.dumps(row), flush=True)
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    spec = llm.spec_info()
    if spec:
        result["acceptance_rate"] = spec["acceptance_rate"]
        result["spec"] = spec
    best_off = max(p["offline"]["tokens_per_s"] for p in result["passes"])
    best_at = max(p["offline_at_clients"]["tokens_per_s"] for p in result["passes"])
    result["summary"] = {"offline_tokens_per_s_best": best_off, "offline_at_clients_tokens_per_s_best": best_at}
    for mode, _, _ in modes:
        best = max(p[mode]["tokens_per_s"] for p in result["passes"])
        result["summary"][f"{mode}_tokens_per_s_best"] = best
        result["summary"][f"{mode}_ratio_best_to_best"] = round(best / best_off, 3)
        result["summary"][f"{mode}_ratio_to_offline_at_clients"] = round(best / best_at, 3)
    Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["summary"]), flush=True)


if __name__ == "__main__":
    main()
