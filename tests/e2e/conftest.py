"""End-to-end fixtures: a real llama-server with Gemma 3 270M and the real
edgeway binary, each on a free port, started once per test session.

The model is a base model: tests assert on the protocol (tokens arrive,
usage, cancellation, error codes), never on the text.
"""
import json
import os
import socket
import sqlite3
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("EDGEWAY_CACHE", Path.home() / ".cache" / "edgeway"))
LLAMA_BIN = CACHE / "bin" / "llama-server"
MODEL = CACHE / "models" / "gemma-3-270m-q4_k_m.gguf"
NATS_BIN = CACHE / "bin" / "nats-server"
EDGEWAY_BIN = Path(os.environ.get("EDGEWAY_BIN", ROOT / "target" / "debug" / "edgeway"))

DEMO_KEY = "sk-edgeway-demo"
OPS_KEY = "sk-edgeway-ops"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# config/edgeway.toml runs both llama-servers itself ([engines.*.process]);
# where a test runs its engines (the fixtures, a fake), edgeway must not.
NO_ENGINE_PROCESSES = {
    "EDGEWAY__ENGINES__LLAMA_LOCAL__PROCESS__ENABLED": "false",
    "EDGEWAY__ENGINES__LLAMA_EMBED__PROCESS__ENABLED": "false",
}


def wait_http(url: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited ({proc.returncode}); log:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout}s; log:\n{log.read_text()[-3000:]}")


class Proc:
    def __init__(self, args, env, log: Path):
        self.log = log
        self.f = open(log, "wb")
        self.p = subprocess.Popen(args, env=env, stdout=self.f, stderr=subprocess.STDOUT, cwd=ROOT)

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
        self.f.close()


_WORKDIR = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report ends with the warnings and errors the edgeway
    processes logged, so a CI failure can be understood from its output."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when != "call" or not rep.failed or not _WORKDIR:
        return
    lines = []
    for log in sorted(_WORKDIR[0].glob("edgeway*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if '"WARN"' in line or '"ERROR"' in line:
                lines.append(f"{log.name}: {line[:600]}")
    if lines:
        rep.sections.append(("edgeway warnings and errors (last 40)", "\n".join(lines[-40:])))


@pytest.fixture(scope="session")
def workdir():
    """Scratch space for the session's servers and their logs; kept (and
    printed at the end) when EDGEWAY_E2E_KEEP is set, for post-mortems."""
    if os.environ.get("EDGEWAY_E2E_KEEP"):
        d = tempfile.mkdtemp(prefix="edgeway-e2e-")
        print(f"\ne2e work directory (kept): {d}")
        _WORKDIR.append(Path(d))
        yield Path(d)
        return
    with tempfile.TemporaryDirectory(prefix="edgeway-e2e-") as d:
        _WORKDIR.append(Path(d))
        yield Path(d)
        _WORKDIR.clear()


@pytest.fixture(scope="session")
def nats(workdir):
    """URL of a nats-server (with JetStream) on a free port; edgeway uses it."""
    assert NATS_BIN.exists(), f"{NATS_BIN} missing: run scripts/setup-deps.sh"
    port = free_port()
    log = workdir / "nats-server.log"
    proc = Proc([str(NATS_BIN), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(workdir / "jetstream")],
                dict(os.environ), log)
    try:
        deadline = time.monotonic() + 20
        while b"Server is ready" not in log.read_bytes():
            assert proc.p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def llama(workdir):
    """URL of a llama-server with 2 slots and /slots enabled."""
    assert LLAMA_BIN.exists(), f"{LLAMA_BIN} missing: run scripts/setup-deps.sh"
    port = free_port()
    log = workdir / "llama-server.log"
    proc = Proc(
        [str(LLAMA_BIN), "-m", str(MODEL), "--alias", "gemma-3-270m", "--host", "127.0.0.1",
         "--port", str(port), "--parallel", "2", "--ctx-size", "4096", "--threads", "2",
         "--slots", "--no-webui",
         "--chat-template-file", str(ROOT / "config" / "templates" / "gemma.jinja")],
        dict(os.environ), log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", 180, proc.p, log)
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def llama_embed(workdir):
    """URL of a second llama-server, started with --embeddings (recent
    llama.cpp serves nothing else on it): scripts/run-embed-engine.sh on a
    free port, as config/edgeway.toml's engine llama-embed."""
    assert LLAMA_BIN.exists(), f"{LLAMA_BIN} missing: run scripts/setup-deps.sh"
    port = free_port()
    log = workdir / "llama-embed.log"
    proc = Proc(["bash", str(ROOT / "scripts" / "run-embed-engine.sh"), str(port)],
                dict(os.environ, EDGEWAY_CACHE=str(CACHE), LLAMA_THREADS="1"), log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", 180, proc.p, log)
        yield url
    finally:
        proc.stop()


class Edgeway:
    def __init__(self, url: str, db: Path):
        self.url = url
        self.db = db

    def task(self, task_id: str):
        """(state, error_code, [states…]) of a task in the SQLite file."""
        con = sqlite3.connect(self.db)
        try:
            row = con.execute("SELECT state, error_code FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
            states = [r[0] for r in con.execute(
                "SELECT state FROM task_transitions WHERE task_id = ? ORDER BY seq", (task_id,))]
            return (row[0] if row else None, row[1] if row else None, states)
        finally:
            con.close()

    def wait_task_state(self, task_id: str, want: str, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while True:
            st = self.task(task_id)
            if st[0] == want or time.monotonic() > deadline:
                return st
            time.sleep(0.05)


@pytest.fixture(scope="session")
def edgeway(llama, llama_embed, nats, workdir):
    """The edgeway binary with config/edgeway.toml, pointed at `llama` and
    `llama_embed`."""
    assert EDGEWAY_BIN.exists(), f"{EDGEWAY_BIN} missing: cargo build"
    port = free_port()
    mqtt_port = free_port()
    data = workdir / "data"
    env = dict(os.environ)
    env.update({
        "EDGEWAY__HTTP__LISTEN": f"127.0.0.1:{port}",
        "EDGEWAY__MQTT__LISTEN": f"127.0.0.1:{mqtt_port}",
        "EDGEWAY__STORE__DATA_DIR": str(data),
        "EDGEWAY__ENGINES__LLAMA_LOCAL__BASE_URL": llama,
        "EDGEWAY__ENGINES__LLAMA_LOCAL__HEALTH_INTERVAL_MS": "500",
        "EDGEWAY__ENGINES__LLAMA_EMBED__BASE_URL": llama_embed,
        **NO_ENGINE_PROCESSES,
        "EDGEWAY__LOG__FORMAT": "json",
        "EDGEWAY__NATS__URL": nats,
    })
    log = workdir / "edgeway.log"
    proc = Proc([str(EDGEWAY_BIN), "serve", "--config", "config/edgeway.toml"], env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", 60, proc.p, log)
        e = Edgeway(url, data / "edgeway.db")
        e.mqtt_port = mqtt_port  # the embedded MQTT broker (tests/e2e/test_mqtt*.py)
        yield e
    finally:
        proc.stop()


def slots(llama_url: str):
    with urllib.request.urlopen(llama_url + "/slots", timeout=5) as r:
        return json.load(r)


def busy_slots(llama_url: str) -> int:
    return sum(1 for s in slots(llama_url) if s.get("is_processing"))
