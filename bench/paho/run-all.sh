#!/usr/bin/env bash
# Run the paho interoperability suite (client_test.py = MQTT 3.1.1,
# client_test5.py = MQTT 5) against three targets, each on a fresh broker:
#   e  edgeway, two devices (myclientid, myclientid2; creds-edgeway.json)
#   o  edgeway, one device: both suite clients are paho:a / paho:b (creds-onedev.json)
#   m  Mosquitto (mosquitto.conf + mosquitto.acl; same runner and credentials as e)
# Writes OUT/{e,o,m}{3,5}-run{N}.{json,out} (results, runner output), the
# broker logs OUT/{e,o,m}{3,5}-run{N}.broker.log and OUT/meta.txt.
#
#   bench/paho/run-all.sh OUT [EDGEWAY_BINARY]
#
# Environment: RUNS (1), TARGETS ("e o m"), SUITES ("3 5"),
# PAHO_SUITE_DIR (/work/paho/suite/head/interoperability, see fetch-suite.sh),
# MQTT_PORT (18830), HTTP_PORT (18080), MOSQ_PORT (18831), MOSQUITTO
# (/usr/sbin/mosquitto), TEST_TIMEOUT (90 s per test), PYTHON (python3).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: run-all.sh OUT [EDGEWAY_BINARY]}
edgeway=${2:-${EDGEWAY:-}}
runs=${RUNS:-1}
targets=${TARGETS:-e o m}
suites=${SUITES:-3 5}
suite_dir=${PAHO_SUITE_DIR:-/work/paho/suite/head/interoperability}
mqtt_port=${MQTT_PORT:-18830}
http_port=${HTTP_PORT:-18080}
mosq_port=${MOSQ_PORT:-18831}
mosquitto=${MOSQUITTO:-/usr/sbin/mosquitto}
timeout=${TEST_TIMEOUT:-90}
python=${PYTHON:-python3}

mkdir -p "$out"
out=$(cd "$out" && pwd)
[ -f "$suite_dir/client_test5.py" ] || { echo "no suite in $suite_dir (bench/paho/fetch-suite.sh)" >&2; exit 2; }
if [[ " $targets " == *" e "* || " $targets " == *" o "* ]]; then
  [ -x "$edgeway" ] || { echo "edgeway binary missing: give it as the second argument" >&2; exit 2; }
fi

{
  echo "date: $(date -u +%FT%TZ)"
  echo "host load: $(uptime)"
  echo "suite: $suite_dir"
  if [ -n "$edgeway" ]; then
    echo "edgeway: $edgeway sha256 $(sha256sum "$edgeway" | cut -c1-16) ($("$edgeway" --version 2>&1))"
  fi
  echo "mosquitto: $("$mosquitto" -h 2>&1 | head -1)"
  echo "runs: $runs targets: $targets suites: $suites timeout: ${timeout}s"
} > "$out/meta.txt"

broker_pid=

wait_port() {
  "$python" - "$1" <<'EOF'
import socket, sys, time
port = int(sys.argv[1])
deadline = time.time() + 60
while time.time() < deadline:
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.1)
sys.exit(1)
EOF
}

stop_broker() {
  if [ -n "$broker_pid" ]; then
    kill "$broker_pid" 2>/dev/null || true
    wait "$broker_pid" 2>/dev/null || true
    broker_pid=
  fi
}
trap stop_broker EXIT

start_broker() { # target name
  local target=$1 name=$2
  case $target in
    e|o)
      local data="$out/data-$name"
      rm -rf "$data"; mkdir -p "$data"
      EDGEWAY__STORE__DATA_DIR="$data" \
      EDGEWAY__MQTT__LISTEN="127.0.0.1:$mqtt_port" \
      EDGEWAY__HTTP__LISTEN="127.0.0.1:$http_port" \
      RUST_LOG="${RUST_LOG:-info}" \
        "$edgeway" serve --config "$here/edgeway-paho.toml" > "$out/$name.broker.log" 2>&1 &
      broker_pid=$!
      port=$mqtt_port ;;
    m)
      sed -e "s|^listener .*|listener $mosq_port 127.0.0.1|" -e "s|ACL_FILE|$here/mosquitto.acl|" \
        "$here/mosquitto.conf" > "$out/mosquitto.conf"
      "$mosquitto" -c "$out/mosquitto.conf" > "$out/$name.broker.log" 2>&1 &
      broker_pid=$!
      port=$mosq_port ;;
  esac
  wait_port "$port" || { echo "broker $name did not listen on $port" >&2; cat "$out/$name.broker.log" >&2; exit 1; }
}

for run in $(seq 1 "$runs"); do
  for target in $targets; do
    case $target in
      e) creds=creds-edgeway.json label="edgeway two devices" ;;
      o) creds=creds-onedev.json label="edgeway one device" ;;
      m) creds=creds-edgeway.json label="mosquitto" ;;
      *) echo "unknown target $target" >&2; exit 2 ;;
    esac
    for suite in $suites; do
      name="$target$suite-run$run"
      start_broker "$target" "$name"
      PAHO_SUITE_DIR="$suite_dir" "$python" "$here/run_suite.py" --suite "$suite" --port "$port" \
        --creds "$here/$creds" --json "$out/$name.json" --label "$label run $run" \
        --timeout "$timeout" > "$out/$name.out" 2>&1 || true
      tail -1 "$out/$name.out"
      stop_broker
      rm -rf "$out/data-$name"
    done
  done
done
