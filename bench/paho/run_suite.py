#!/usr/bin/env python3
"""Run one file of the Eclipse paho interoperability suite against a broker.

The suite (github.com/eclipse/paho.mqtt.testing, `interoperability/`) is not
part of this repository (EPL/EDL code); fetch-suite.sh puts it in
SUITE_DIR. Its files run unchanged. This runner only wraps the suite's own
client classes:

- `Client.__init__` renames a client id by the credentials table (edgeway:
  a device id has no spaces, so the suite's "clean retained" becomes
  `clean_retained`; the one-device variant maps the suite's two clients to
  `paho:a` / `paho:b`);
- `Client.connect` adds the table's user name and password (edgeway refuses
  anonymous clients) and connects to --host / --port whatever the suite
  passes (its own `-h` option cannot be used: `o in ("--help")` is a
  substring test, so `-h` prints the usage and exits);
- each test gets --timeout seconds (SIGALRM raises in the test): some tests
  loop without bound for a message an isolating broker never delivers.

The suite's `__main__` block runs as written (it sets the topics and parses
`-p`); its closing `unittest.main()` is replaced by a runner that records
every test's outcome, time and failure text in --json.

Credentials file (JSON): {"clients": {"<suite client id>": {"client_id":
"<sent instead>", "username": "...", "password": "..."}}}. A client id not
listed (the zero-length one) is sent as is, without credentials.
"""

import argparse
import io
import json
import os
import runpy
import signal
import sys
import time
import traceback
import unittest


class TestTimeout(Exception):
    """Raised in the main thread when a test runs past --timeout."""


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=["3", "5"], required=True,
                   help="3: client_test.py (MQTT 3.1.1), 5: client_test5.py (MQTT 5)")
    p.add_argument("--suite-dir", default=os.environ.get("PAHO_SUITE_DIR", "/work/paho/suite/head/interoperability"),
                   help="the suite's interoperability/ directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--creds", required=True, help="credentials and renames (JSON)")
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--label", default="", help="free text stored in the JSON (broker, variant, binary)")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds per test")
    p.add_argument("--only", action="append", default=[],
                   help="run only this test (method name; repeatable)")
    return p.parse_args()


def wrap_client(cls, table, host, port):
    """Rename client ids and add credentials on the suite's client class."""
    orig_init = cls.__init__
    orig_connect = cls.connect

    def __init__(self, clientid):
        orig_init(self, clientid)
        key = clientid.decode("utf-8") if isinstance(clientid, bytes) else clientid
        entry = table.get(key)
        self._paho_runner_entry = entry
        if entry and entry.get("client_id") is not None:
            new = entry["client_id"]
            self.clientid = new.encode("utf-8") if isinstance(clientid, bytes) else new

    def connect(self, *args, **kwargs):
        # The suite always passes host and port by keyword.
        kwargs["host"] = host
        kwargs["port"] = port
        entry = getattr(self, "_paho_runner_entry", None)
        if entry:
            if kwargs.get("username") is None and entry.get("username"):
                kwargs["username"] = entry["username"]
            if kwargs.get("password") is None and entry.get("password"):
                # The suite's formats write the password as bytes, the user name as str.
                kwargs["password"] = entry["password"].encode("utf-8")
        return orig_connect(self, *args, **kwargs)

    cls.__init__ = __init__
    cls.connect = connect


class Recorder(unittest.TestResult):
    """Keeps per-test outcome and time; re-arms the per-test alarm."""

    def __init__(self, timeout, out):
        super().__init__()
        self.timeout = timeout
        self.out = out
        self.tests = {}
        self._t0 = None

    def _name(self, test):
        return getattr(test, "_testMethodName", str(test))

    def startTest(self, test):
        super().startTest(test)
        self._t0 = time.monotonic()
        self.tests[self._name(test)] = {"status": "pass", "seconds": None, "detail": ""}
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        print("=== %s" % self._name(test), file=self.out, flush=True)

    def stopTest(self, test):
        signal.setitimer(signal.ITIMER_REAL, 0)
        rec = self.tests.get(self._name(test))
        if rec is not None:
            rec["seconds"] = round(time.monotonic() - self._t0, 2)
            print("--- %s %s %.2fs" % (self._name(test), rec["status"], rec["seconds"]), file=self.out, flush=True)
        super().stopTest(test)

    def _record(self, test, status, err):
        text = self._exc_info_to_string(err, test) if err else ""
        name = self._name(test)
        if name not in self.tests:  # setUpClass / tearDownClass failures
            self.tests[name] = {"status": status, "seconds": None, "detail": ""}
        if err and err[0] is TestTimeout:
            status = "timeout"
        self.tests[name]["status"] = status
        self.tests[name]["detail"] = text[-4000:]
        print(text, file=self.out, flush=True)

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", err)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "fail", err)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.tests[self._name(test)]["status"] = "skip"
        self.tests[self._name(test)]["detail"] = reason


def main():
    args = parse_args()
    args.json = os.path.abspath(args.json)
    suite_dir = os.path.abspath(args.suite_dir)
    suite_file = os.path.join(suite_dir, "client_test.py" if args.suite == "3" else "client_test5.py")
    with open(args.creds) as f:
        table = json.load(f).get("clients", {})

    sys.path.insert(0, suite_dir)
    os.chdir(suite_dir)
    import mqtt.clients.V311 as v311  # noqa: E402  (after sys.path)
    import mqtt.clients.V311.main as v311_main
    import mqtt.clients.V5.main as v5_main

    # Some stored versions of the suite lack mqtt/clients/V311/__init__.py's
    # exports; bind them so `mqtt_client.Client` works either way.
    if not hasattr(v311, "Client"):
        v311.Client = v311_main.Client
        v311.Callback = v311_main.Callback
    wrap_client(v311_main.Client, table, args.host, args.port)
    wrap_client(v5_main.Client, table, args.host, args.port)

    def on_alarm(signum, frame):
        raise TestTimeout("test ran past %.0f s (runner timeout)" % args.timeout)

    signal.signal(signal.SIGALRM, on_alarm)

    out = sys.stdout
    result_holder = {}
    started = time.time()

    def run_tests(*_a, **_kw):
        module = sys.modules["__main__"]
        loader = unittest.TestLoader()
        if args.only:
            suite = unittest.TestSuite(module.Test(name) for name in args.only)
        else:
            suite = loader.loadTestsFromTestCase(module.Test)
        result = Recorder(args.timeout, out)
        # setUpClass (the suite's cleanup) runs before the first startTest:
        # give it the same bound.
        signal.setitimer(signal.ITIMER_REAL, args.timeout)
        try:
            suite.run(result)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        result_holder["result"] = result

    unittest.main = run_tests
    sys.argv = [suite_file, "-p", str(args.port)]
    try:
        runpy.run_path(suite_file, run_name="__main__")
    except SystemExit:
        pass
    except BaseException:
        traceback.print_exc()

    result = result_holder.get("result")
    tests = result.tests if result else {}
    passed = sum(1 for t in tests.values() if t["status"] == "pass")
    doc = {
        "suite": "client_test.py" if args.suite == "3" else "client_test5.py",
        "mqtt": "3.1.1" if args.suite == "3" else "5",
        "label": args.label,
        "host": args.host,
        "port": args.port,
        "creds": os.path.basename(args.creds),
        "suite_dir": suite_dir,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        "passed": passed,
        "run": len(tests),
        "tests": tests,
    }
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    print("%s %s: %d / %d passed" % (args.label, doc["suite"], passed, len(tests)), flush=True)
    # Client receive threads are daemon-less _thread threads; do not wait.
    os._exit(0)


if __name__ == "__main__":
    main()
