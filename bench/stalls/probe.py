"""A witness for `soak.sh`: one request every 20 ms on one kept-alive
connection, in a process of its own.

    python3 probe.py URL OUT [MODEL [API_KEY]]

Without MODEL: GET URL. With it: POST a non-streaming chat completion of
8 tokens for MODEL (with API_KEY as a bearer token if given). Writes to
OUT a line `L <wall time of the send> <ms>` for every answer slower than
5 ms, `S <second> <ms>` with each second's slowest, and `E <time> <why>`
for a failed request (then reconnects).
"""
import http.client
import json
import sys
import time
import urllib.parse

url = urllib.parse.urlparse(sys.argv[1])
out = open(sys.argv[2], "w", buffering=1)
model = sys.argv[3] if len(sys.argv) > 3 else None
key = sys.argv[4] if len(sys.argv) > 4 else None
body = None
headers = {"Content-Type": "application/json"}
if model:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello"}],
                       "stream": False, "max_tokens": 8})
if key:
    headers["Authorization"] = "Bearer " + key


def connect():
    return http.client.HTTPConnection(url.hostname, url.port, timeout=10)


conn = connect()
second, slowest = int(time.time()), 0.0
while True:
    sent = time.time()
    t0 = time.perf_counter()
    try:
        if body:
            conn.request("POST", url.path, body, headers)
        else:
            conn.request("GET", url.path)
        answer = conn.getresponse()
        answer.read()
        if answer.status != 200:
            out.write(f"E {sent:.3f} status {answer.status}\n")
    except Exception as e:  # the gateway or the bench went away, or a reset
        out.write(f"E {sent:.3f} {e}\n")
        conn = connect()
        time.sleep(0.1)
        continue
    ms = (time.perf_counter() - t0) * 1000
    slowest = max(slowest, ms)
    if ms > 5:
        out.write(f"L {sent:.3f} {ms:.2f}\n")
    if int(sent) != second:
        out.write(f"S {second} {slowest:.2f}\n")
        second, slowest = int(sent), 0.0
    time.sleep(0.02)
