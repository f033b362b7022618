"""A client that hangs up mid-stream cancels its task, and the real engine
stops generating: llama-server's /slots shows the slot idle again."""
import json
import socket
import time

from conftest import DEMO_KEY, busy_slots


def open_stream(url: str, max_tokens: int) -> tuple[socket.socket, str]:
    """Starts a streamed completion over a raw socket; returns the socket
    (after the first chunk) and the task id."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({
        "model": "general-chat", "stream": True, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}],
    }).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {DEMO_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head = buf.split(b"\r\n\r\n")[0].decode()
    assert " 200 " in head.splitlines()[0], head
    task_id = next(l.split(":", 1)[1].strip() for l in head.splitlines() if l.lower().startswith("x-task-id"))
    # Wait for real tokens (not just the role chunk).
    while buf.count(b'"content"') < 3:
        buf += s.recv(65536)
    return s, task_id


def test_disconnect_cancels_the_task_and_frees_the_engine_slot(edgeway, llama):
    s, task_id = open_stream(edgeway.url, max_tokens=2000)
    assert busy_slots(llama) == 1
    s.close()
    t0 = time.monotonic()
    while busy_slots(llama) != 0:
        assert time.monotonic() - t0 < 10, "llama-server slot still busy 10 s after the disconnect"
        time.sleep(0.01)
    state, code, states = edgeway.wait_task_state(task_id, "CANCELLED")
    assert state == "CANCELLED", states
    assert code == "REQUEST_CANCELLED"
    assert states[-2:] == ["STREAMING", "CANCELLED"]
