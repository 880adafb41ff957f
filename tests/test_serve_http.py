"""docproc serve's HTTP protocol on its own (a trivial application, no model): a client that
sends a request's headers too slowly is closed, one that sends them in time is answered."""
from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("h11")


async def hello(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def address():
    import uvicorn

    from docproc.openai_compat.server import header_timeout_protocol

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(hello, http=header_timeout_protocol(0.6), lifespan="off",
                                           log_level="error", timeout_keep_alive=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield sock.getsockname()
    server.should_exit = True
    thread.join(10)


def closed_within(conn: socket.socket, seconds: float) -> bool:
    """Whether the server closes conn within `seconds` (bytes it sends before are read past)."""
    conn.settimeout(seconds)
    try:
        while conn.recv(4096):
            pass
        return True
    except TimeoutError:
        return False


REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def trickle(sock, data: bytes, pause: float) -> None:
    """Send data a byte at a time, pause seconds apart, until the server closes the connection."""
    for byte in data:
        time.sleep(pause)
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return


def test_headers_sent_too_slowly_close_the_connection(address):
    idle = socket.create_connection(address)  # connects, sends nothing
    slow = socket.create_connection(address)  # sends its headers a byte at a time, never done in time
    slow.sendall(b"GET / HTTP/1.1\r\nHo")
    t0 = time.monotonic()
    trickle(slow, b"st: x\r\nX-A: 1\r\n", 0.05)
    assert closed_within(idle, 2.0) and closed_within(slow, 2.0)
    assert time.monotonic() - t0 < 3.0


def test_a_request_in_time_is_answered_and_the_next_one_is_held_to_the_same_limit(address):
    conn = socket.create_connection(address)
    conn.sendall(REQUEST)
    conn.settimeout(5)
    got = b""
    while not got.endswith(b"ok"):
        got += conn.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    time.sleep(0.3)
    conn.sendall(REQUEST)  # the next request on the kept connection, in time: answered too
    got = b""
    while not got.endswith(b"ok"):
        got += conn.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    conn.sendall(b"GET / HT")  # a third one begun and left: closed (keep-alive alone waited 5 s a byte)
    trickle(conn, b"TP/1.1\r\n", 0.1)
    assert closed_within(conn, 2.0)
