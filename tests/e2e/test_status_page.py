"""The status page in a real headless Chromium (Debian's, unpacked by
scripts/setup-deps.sh into the cache), driven over the DevTools protocol:
with tasks running, the page shows them; a cancel from the page ends one
CANCELLED; a screenshot is saved under the test's tmp dir
(`status-page.png`, its path printed).

The engine is a slow fake (one token every 100 ms, in this file), so the
tasks run long enough to be seen without loading the CPU; edgeway is the
real binary, serving the page on its `admin_listen` port.
"""
import asyncio
import base64
import hashlib
import json
import os
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import websockets

from conftest import CACHE, DEMO_KEY, EDGEWAY_BIN, OPS_KEY, Proc, free_port, wait_http

CHROMIUM = CACHE / "bin" / "chromium"


class SlowEngine(BaseHTTPRequestHandler):
    """An OpenAI-style engine that streams one token every 100 ms, up to
    600, and stops when the client goes away."""
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self._json(404, {"error": "no"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not body.get("stream"):
            self._json(200, {"id": "x", "object": "chat.completion", "model": "fake-model",
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok"},
                                          "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for _ in range(600):
                chunk = {"id": "x", "object": "chat.completion.chunk", "model": "fake-model",
                         "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.1)
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _json(self, status, v):
        data = json.dumps(v).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture()
def gateway(tmp_path):
    """edgeway (the real binary) on a slow fake engine, with the admin
    routes on their own port. Yields (business url, admin url)."""
    assert EDGEWAY_BIN.exists(), f"{EDGEWAY_BIN} missing: cargo build"
    engine = ThreadingHTTPServer(("127.0.0.1", 0), SlowEngine)
    engine.daemon_threads = True
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    port, admin = free_port(), free_port()
    cfg = tmp_path / "edgeway.toml"
    cfg.write_text(f"""
node_id = "status-e2e"
[http]
listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{admin}"
[store]
data_dir = "{tmp_path / 'data'}"
[applications.demo]
tenant = "demo"
api_key_sha256 = ["{sha(DEMO_KEY)}"]
max_priority = "P1"
default_priority = "P2"
[applications.ops]
tenant = "demo"
api_key_sha256 = ["{sha(OPS_KEY)}"]
admin = true
[engines.fake]
type = "openai"
base_url = "http://127.0.0.1:{engine.server_address[1]}"
model = "fake-model"
max_concurrency = 2
health_interval_ms = 200
[models.general-chat]
instances = ["fake"]
context_tokens = 2048
max_output_tokens = 1000
""")
    log = tmp_path / "edgeway.log"
    proc = Proc([str(EDGEWAY_BIN), "serve", "--config", str(cfg)], dict(os.environ), log)
    try:
        wait_http(f"http://127.0.0.1:{admin}/ready", 60, proc.p, log)
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
    finally:
        proc.stop()
        engine.shutdown()


def submit(url: str) -> str:
    body = json.dumps({"model": "general-chat", "stream": True, "max_tokens": 1000,
                       "messages": [{"role": "user", "content": "go"}]}).encode()
    req = urllib.request.Request(url + "/v1/tasks", data=body, method="POST", headers={
        "Authorization": f"Bearer {DEMO_KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["task_id"]


def task_status(url: str, task_id: str) -> str:
    req = urllib.request.Request(f"{url}/v1/tasks/{task_id}", headers={"Authorization": f"Bearer {DEMO_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["status"]


class Page:
    """One Chromium tab over the DevTools protocol."""

    def __init__(self, ws):
        self.ws = ws
        self.next_id = 0

    async def call(self, method: str, **params):
        self.next_id += 1
        my = self.next_id
        await self.ws.send(json.dumps({"id": my, "method": method, "params": params}))
        while True:
            msg = json.loads(await asyncio.wait_for(self.ws.recv(), 30))
            if msg.get("id") == my:
                assert "error" not in msg, msg
                return msg["result"]

    async def eval(self, expr: str):
        r = await self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")

    async def until(self, expr: str, what: str, timeout: float = 20):
        deadline = time.monotonic() + timeout
        while True:
            v = await self.eval(expr)
            if v:
                return v
            assert time.monotonic() < deadline, f"the page never showed {what}"
            await asyncio.sleep(0.1)


@pytest.fixture()
def chromium(tmp_path):
    """A headless Chromium with a DevTools port; yields the port."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} missing: run scripts/setup-deps.sh")
    port = free_port()
    log = tmp_path / "chromium.log"
    proc = Proc([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 f"--remote-debugging-port={port}", f"--user-data-dir={tmp_path / 'profile'}",
                 "--window-size=1400,1000", "about:blank"], dict(os.environ), log)
    try:
        wait_http(f"http://127.0.0.1:{port}/json/version", 60, proc.p, log)
        yield port
    finally:
        proc.stop()


async def drive(devtools: int, url: str, admin: str, tasks: list, shot: Path):
    with urllib.request.urlopen(f"http://127.0.0.1:{devtools}/json/list", timeout=10) as r:
        target = next(t for t in json.load(r) if t["type"] == "page")
    async with websockets.connect(target["webSocketDebuggerUrl"], max_size=64 << 20) as ws:
        page = Page(ws)
        await page.call("Page.enable")
        await page.call("Page.navigate", url=admin + "/status")
        await page.until("document.readyState === 'complete' && !document.getElementById('login').hidden",
                         "the key form")
        # A plain application's key is refused, and the form says so.
        await page.eval(f"document.getElementById('key').value = {json.dumps(DEMO_KEY)};"
                        "document.getElementById('login-form').requestSubmit(); true")
        await page.until("document.getElementById('login-error').textContent.includes('admin')",
                         "the refusal of a plain key")
        await page.eval(f"document.getElementById('key').value = {json.dumps(OPS_KEY)};"
                        "document.getElementById('login-form').requestSubmit(); true")
        # Both tasks, with their client kind and application, and tokens.
        for t in tasks:
            row = f"document.querySelector('tr[data-task-id=\"{t}\"]')"
            await page.until(f"{row} !== null && {row}.cells[3].textContent === 'http'"
                             f" && {row}.cells[4].textContent === 'demo'"
                             f" && Number({row}.cells[7].textContent) > 0", f"task {t} running")
        assert await page.eval("document.getElementById('tasks-total').textContent") == f"({len(tasks)} live)"
        assert await page.eval("document.querySelector('#engines tbody tr').cells[1].textContent") == "up"
        assert await page.eval("sessionStorage.getItem('edgeway-admin-key')") == OPS_KEY
        assert OPS_KEY not in await page.eval("location.href"), "the key is never in the URL"
        # Cancel the first from the page.
        await page.eval(f"document.querySelector('tr[data-task-id=\"{tasks[0]}\"] button.cancel').click(); true")
        deadline = time.monotonic() + 20
        while task_status(url, tasks[0]) != "CANCELLED":
            assert time.monotonic() < deadline, "the cancel from the page did not end the task"
            await asyncio.sleep(0.1)
        await page.until(f"document.querySelector('tr[data-task-id=\"{tasks[0]}\"]') === null"
                         " && [...document.querySelectorAll('#failures tbody tr')].some("
                         f"r => r.cells[6].textContent === '{tasks[0]}' && r.cells[1].textContent === 'REQUEST_CANCELLED')",
                         "the cancelled task among the failures")
        assert await page.eval(f"document.querySelector('tr[data-task-id=\"{tasks[1]}\"]') !== null")
        # The charts were drawn.
        assert await page.eval("document.querySelectorAll('#traffic polyline').length") == 2
        png = await page.call("Page.captureScreenshot", format="png")
        shot.write_bytes(base64.b64decode(png["data"]))


def test_the_status_page_shows_running_tasks_and_cancels_one(gateway, chromium, tmp_path):
    url, admin = gateway
    tasks = [submit(url), submit(url)]
    shot = tmp_path / "status-page.png"
    try:
        asyncio.run(drive(chromium, url, admin, tasks, shot))
    finally:
        for t in tasks:
            req = urllib.request.Request(f"{url}/v1/tasks/{t}", method="DELETE",
                                         headers={"Authorization": f"Bearer {DEMO_KEY}"})
            try:
                urllib.request.urlopen(req, timeout=10).close()
            except urllib.error.HTTPError:
                pass
    assert shot.stat().st_size > 10_000
    print(f"\nstatus page screenshot: {shot}")
