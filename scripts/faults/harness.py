"""What every fault run needs: a scratch directory, nats-server, counting
fake engines (fake_engine.py) and the edgeway binary with a config written
for the run, plus small HTTP / MQTT / NATS clients.

Process handling (Proc, free_port, wait_http) is the e2e suite's
(tests/e2e/conftest.py), imported, not copied. Run with the project's venv:
$EDGEWAY_CACHE/venv/bin/python (scripts/setup-deps.sh makes it).

Owns: starting and stopping the processes of a fault run, its config, the
clients. Does not own: any acceptance condition (each script has its own).
"""
import hashlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from conftest import NATS_BIN, Proc, free_port, wait_http  # noqa: E402

import httpx  # noqa: E402

DEMO_KEY = "sk-edgeway-demo"
# An admin application's key: /metrics and the details of /ready need one on
# the business port.
OPS_KEY = "sk-edgeway-ops"
HERE = Path(__file__).resolve().parent
PY = sys.executable


def edgeway_bin() -> Path:
    """$EDGEWAY_BIN, else the release build in $CARGO_TARGET_DIR or target/."""
    if os.environ.get("EDGEWAY_BIN"):
        return Path(os.environ["EDGEWAY_BIN"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "release" / "edgeway"


def commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def sha256(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def device_password(device: str) -> str:
    return f"pw-{device}"


class Run:
    """One fault run's processes, in a scratch directory removed at the end
    (kept when FAULTS_KEEP is set)."""

    def __init__(self, name: str):
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"edgeway-fault-{name}-"))
        self.procs = []
        self.engines = {}  # name -> (Proc, url, log path, model)
        self.nats_url = None
        self.nats_port = None
        self.nats_proc = None
        self.edgeway = None
        self.http_port = free_port()
        self.mqtt_port = free_port()
        self.data_dir = self.dir / "data"
        self.started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_all()
        if os.environ.get("FAULTS_KEEP"):
            print(f"(kept {self.dir})")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    def stop_all(self):
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()

    # --- processes -------------------------------------------------------

    def start_nats(self, port=None):
        assert NATS_BIN.exists(), f"{NATS_BIN} missing: run scripts/setup-deps.sh"
        self.nats_port = port or self.nats_port or free_port()
        log = self.dir / f"nats-{time.monotonic_ns()}.log"
        proc = Proc([str(NATS_BIN), "-a", "127.0.0.1", "-p", str(self.nats_port)], dict(os.environ), log)
        deadline = time.monotonic() + 20
        while b"Server is ready" not in log.read_bytes():
            assert proc.p.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        self.procs.append(proc)
        self.nats_proc = proc
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        return proc

    def stop_nats(self):
        self.nats_proc.stop()
        self.procs.remove(self.nats_proc)
        self.nats_proc = None

    def start_engine(self, name: str, model: str, tokens=20, delay_ms=50, port=None):
        port = port or free_port()
        log = self.dir / f"engine-{name}.requests"
        proc = Proc([PY, str(HERE / "fake_engine.py"), "--port", str(port), "--model", model, "--tokens", str(tokens),
                     "--delay-ms", str(delay_ms), "--log", str(log)], dict(os.environ), self.dir / f"engine-{name}.out")
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 20, proc.p, proc.log)
        self.procs.append(proc)
        self.engines[name] = (proc, url, log, model)
        return proc

    def engine_requests(self, name: str):
        """The nonces the engine `name` was asked to run, one per request."""
        log = self.engines[name][2]
        return log.read_text().split() if log.exists() else []

    def write_config(self, devices=(), extra="") -> Path:
        """Models `model-{engine}` on each started engine; application demo
        with the demo key; `devices` over MQTT; NATS when started."""
        lines = [
            'node_id = "fault-node"',
            "[http]", f'listen = "127.0.0.1:{self.http_port}"',
            "[store]", f'data_dir = "{self.data_dir}"',
            "[log]", 'format = "json"', 'level = "info"',
            "[resources]", "gpu = false",
            "[applications.demo]", 'tenant = "demo"', f'api_key_sha256 = ["{sha256(DEMO_KEY)}"]',
            'max_priority = "P1"', 'default_priority = "P2"',
            "[applications.ops]", 'tenant = "demo"', f'api_key_sha256 = ["{sha256(OPS_KEY)}"]', "admin = true",
            "[mqtt]", f'listen = "127.0.0.1:{self.mqtt_port}"', 'topic_prefix = "ai/v1"', "coalesce_ms = 0",
        ]
        for d in devices:
            lines += [f"[devices.{d}]", 'tenant = "demo"', 'application = "demo"',
                      f'password_sha256 = "{sha256(device_password(d))}"']
        if self.nats_url:
            lines += ["[nats]", f'url = "{self.nats_url}"', "reconnect_max_delay_ms = 500"]
        for name, (_, url, _, model) in self.engines.items():
            lines += [f"[engines.{name}]", 'type = "openai"', f'base_url = "{url}"', f'model = "{model}"',
                      "max_concurrency = 64", "health_interval_ms = 500", 'location = "local"']
        for name in self.engines:
            lines += [f"[models.model-{name}]", f'instances = ["{name}"]', "context_tokens = 4096",
                      "max_output_tokens = 512", "queue_capacity = 1024"]
        lines.append(extra)
        path = self.dir / "edgeway.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start_edgeway(self, config: Path, env=None, timeout=60):
        e = dict(os.environ)
        e.update(env or {})
        log = self.dir / f"edgeway-{len([p for p in self.procs if 'edgeway' in str(p.log)])}.log"
        binary = edgeway_bin()
        assert binary.exists(), f"{binary} missing: cargo build --release (or set EDGEWAY_BIN)"
        proc = Proc([str(binary), "serve", "--config", str(config)], e, log)
        self.procs.append(proc)
        self.edgeway = proc
        wait_http(self.url + "/health", timeout, proc.p, log)
        return proc

    def kill_edgeway(self):
        """kill -9: no shutdown code runs."""
        self.edgeway.p.send_signal(signal.SIGKILL)
        self.edgeway.p.wait()
        self.edgeway.f.close()
        self.procs.remove(self.edgeway)
        self.edgeway = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def db(self):
        return self.data_dir / "edgeway.db"

    def admin_get(self, path: str, timeout=5):
        """GET `path` with the admin key (`/metrics`, `/ready`'s details)."""
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {OPS_KEY}"})
        return urllib.request.urlopen(req, timeout=timeout)

    def ready(self):
        try:
            with self.admin_get("/ready", timeout=2) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
        except Exception as e:  # noqa: BLE001
            return None, {"error": str(e)}

    def tasks(self):
        """{task_id: (state, error_code, request_id)} from the store, and
        {task_id: [states…]} of the transitions."""
        con = sqlite3.connect(self.db)
        try:
            tasks = {r[0]: (r[1], r[2], r[3]) for r in
                     con.execute("SELECT task_id, state, error_code, request_id FROM tasks")}
            trans = {}
            for tid, st in con.execute("SELECT task_id, state FROM task_transitions ORDER BY task_id, seq"):
                trans.setdefault(tid, []).append(st)
            return tasks, trans
        finally:
            con.close()


TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "REJECTED", "TIMED_OUT"}


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# --- clients ---------------------------------------------------------------

def chat_body(model: str, nonce: str, max_tokens=None, **extra):
    body = {"model": model, "stream": True,
            "messages": [{"role": "user", "content": f"fault run nonce={nonce}"}], **extra}
    if max_tokens:
        body["max_tokens"] = max_tokens
    return body


def result(end, code=None, text="", acked=False, first=None):
    """What a client saw of one task: `end` is done, error, timeout or
    broken (the connection died); `first` the seconds to the first delta."""
    return {"end": end, "code": code, "text": text, "acked": acked, "first": first}


async def http_task(client: httpx.AsyncClient, url: str, body: dict, idem_key=None, timeout=60.0):
    """Streams one chat completion (see `result`)."""
    headers = {"authorization": f"Bearer {DEMO_KEY}"}
    if idem_key:
        headers["idempotency-key"] = idem_key
    t0 = time.monotonic()
    text, code, acked, first = "", None, False, None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers,
                                 timeout=timeout) as r:
            if r.status_code != 200:
                data = json.loads(await r.aread() or b"{}")
                return result("error", (data.get("error") or {}).get("code"))
            acked = True
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    code = (ev["error"] or {}).get("code")
                    continue
                for ch in ev.get("choices", []):
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        if first is None:
                            first = time.monotonic() - t0
                        text += piece
        return result("error" if code else "done", code, text, acked, first)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return result("broken", type(e).__name__, text, acked, first)


def wait_for(cond, timeout: float, every=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def verdict(name: str, checks: dict, figures: dict) -> int:
    """Prints the run's figures and checks as a block for RELIABILITY.md;
    returns the exit status (1 when a check failed)."""
    ok = all(checks.values())
    print(f"\n### {name}: {'PASS' if ok else 'FAIL'}")
    print(f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit()}, binary {edgeway_bin()}")
    for k, v in figures.items():
        print(f"- {k}: {v}")
    for k, v in checks.items():
        print(f"- [{'x' if v else ' '}] {k}")
    return 0 if ok else 1


class Device:
    """One MQTT device (paho, MQTT 3.1.1) subscribed to its responses; the
    events of each request id come out on an asyncio queue."""

    def __init__(self, run: Run, device: str, loop):
        import paho.mqtt.client as mqtt
        self.device, self.loop, self.queues = device, loop, {}
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=device, protocol=mqtt.MQTTv311)
        self.c.username_pw_set(device, device_password(device))
        self.c.on_message = self._on_message
        self.connected = __import__("threading").Event()
        self.c.on_connect = lambda c, u, f, rc, p: (c.subscribe(f"ai/v1/{device}/res/#", qos=1), self.connected.set())
        self.c.connect("127.0.0.1", run.mqtt_port, keepalive=30)
        self.c.loop_start()
        assert self.connected.wait(10), f"{device}: no CONNACK"

    def _on_message(self, c, u, msg):
        ev = json.loads(msg.payload)
        q = self.queues.get(ev.get("request_id"))
        if q is not None:
            self.loop.call_soon_threadsafe(q.put_nowait, ev)

    def send(self, request_id: str, body: dict, qos=1):
        import asyncio
        q = self.queues.setdefault(request_id, asyncio.Queue())
        self.c.publish(f"ai/v1/{self.device}/req", json.dumps(dict(body, request_id=request_id)), qos=qos)
        return q

    def close(self):
        self.c.loop_stop()
        self.c.disconnect()


async def mqtt_task(dev: Device, request_id: str, body: dict, timeout: float):
    """Sends one request and follows its events (see `result`)."""
    import asyncio
    t0 = time.monotonic()
    q = dev.send(request_id, body)
    text, acked, first = "", False, None
    try:
        while True:
            ev = await asyncio.wait_for(q.get(), timeout)
            acked = acked or ev["type"] != "error"
            if ev["type"] == "delta":
                if first is None:
                    first = time.monotonic() - t0
                text += ev.get("text", "")
            elif ev["type"] in ("done", "error"):
                return result(ev["type"], ev.get("code"), text, acked, first)
    except asyncio.TimeoutError:
        return result("timeout", None, text, acked, first)


async def nats_task(nc, body: dict, timeout: float, headers=None):
    """One `ai.v1.chat` request on a fresh inbox (see `result`)."""
    import asyncio
    inbox = nc.new_inbox()
    q = asyncio.Queue()

    async def cb(msg):
        await q.put(msg)

    sub = await nc.subscribe(inbox, cb=cb)
    h = {"Authorization": f"Bearer {DEMO_KEY}"}
    h.update(headers or {})
    t0 = time.monotonic()
    text, acked, first = "", False, None
    try:
        await nc.publish("ai.v1.chat", json.dumps(body).encode(), reply=inbox, headers=h)
        while True:
            msg = await asyncio.wait_for(q.get(), timeout)
            kind = (msg.headers or {}).get("Edgeway-Event")
            if kind == "keepalive" or not msg.data:
                continue
            ev = json.loads(msg.data)
            acked = acked or ev.get("type") != "error"
            if ev.get("type") == "delta":
                if first is None:
                    first = time.monotonic() - t0
                text += ev.get("text", "")
            elif ev.get("type") in ("done", "error"):
                return result(ev["type"], ev.get("code"), text, acked, first)
    except asyncio.TimeoutError:
        return result("timeout", None, text, acked, first)
    except Exception as e:  # noqa: BLE001 (the bus went away under the request)
        return result("broken", type(e).__name__, text, acked, first)
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001
            pass
