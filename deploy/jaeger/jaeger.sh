#!/usr/bin/env bash
# Run a local Jaeger (all-in-one, in-memory storage) receiving OTLP, for dagfold's tracing tests
# and for looking at a job's trace (docs/operations.md, "Tracing"). No Docker needed.
#
#   deploy/jaeger/jaeger.sh fetch    build the pinned Jaeger once into .cache/jaeger/<version>/jaeger
#                                    (Go toolchain and the Go module proxy; several minutes on 2 cores)
#   deploy/jaeger/jaeger.sh start    write the config, start it in the background, wait until ready
#   deploy/jaeger/jaeger.sh stop     SIGTERM, wait, then SIGKILL; harmless if not running
#   deploy/jaeger/jaeger.sh status   exit 0 when it runs
#
# The module github.com/jaegertracing/jaeger is tagged v1.x for Go; each v1 release carries the v2
# binary (cmd/jaeger, an OpenTelemetry Collector distribution): v1.76.0 is Jaeger v2.13.0. Its go.mod
# has a replace directive, so `go install module@version` refuses it: the module is downloaded and
# built in its own folder. The UI's assets are not in the Go module (a git submodule built with npm),
# so this build's UI at the query port is Jaeger's placeholder page: the query API (/api/traces/<id>,
# /api/v3/...) is complete; for the UI see JAEGER_UI_ASSETS below.
#
# Environment:
#   JAEGER_VERSION=v1.76.0          the Go module version (pinned; the folder under .cache/jaeger)
#   JAEGER_OTLP_GRPC_PORT=4317      OTLP/gRPC receiver      (every port listens on 127.0.0.1 only)
#   JAEGER_OTLP_HTTP_PORT=4318      OTLP/HTTP receiver
#   JAEGER_QUERY_PORT=16686         query API and UI (http://127.0.0.1:16686/api/traces/<trace id>)
#   JAEGER_QUERY_GRPC_PORT=16685    query gRPC API
#   JAEGER_HEALTH_PORT=13133        health check (/status)
#   JAEGER_MAX_TRACES=100000        traces kept in memory (the oldest go first)
#   JAEGER_DATA=.cache/jaeger/run-$JAEGER_QUERY_PORT   config, log and pid file
#   JAEGER_START_TIMEOUT=60         seconds to wait for readiness
#   JAEGER_UI_ASSETS=               a built jaeger-ui folder (index.html, static/) to serve as the UI;
#                                   default .cache/jaeger/ui-<version> when it exists (jaeger-ui's tag of the
#                                   same number, built with `npm ci && npm run build` in its checkout:
#                                   packages/jaeger-ui/build; node 20 builds v1.76.0 with --engine-strict=false)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VERSION="${JAEGER_VERSION:-v1.76.0}"
MODULE=github.com/jaegertracing/jaeger
CACHE="$ROOT/.cache/jaeger/$VERSION"
BIN="$CACHE/jaeger"
GRPC="${JAEGER_OTLP_GRPC_PORT:-4317}"
HTTP="${JAEGER_OTLP_HTTP_PORT:-4318}"
QUERY="${JAEGER_QUERY_PORT:-16686}"
QUERY_GRPC="${JAEGER_QUERY_GRPC_PORT:-16685}"
HEALTH="${JAEGER_HEALTH_PORT:-13133}"
MAX_TRACES="${JAEGER_MAX_TRACES:-100000}"
DATA="${JAEGER_DATA:-$ROOT/.cache/jaeger/run-$QUERY}"
START_TIMEOUT="${JAEGER_START_TIMEOUT:-60}"
UI_ASSETS="${JAEGER_UI_ASSETS:-}"
# a jaeger-ui build kept in the cache (see the header) is served when none is named
[[ -z "$UI_ASSETS" && -f "$ROOT/.cache/jaeger/ui-$VERSION/index.html" ]] && UI_ASSETS="$ROOT/.cache/jaeger/ui-$VERSION"
HOST=127.0.0.1

die() { echo "jaeger.sh: $*" >&2; exit 1; }

for p in "$GRPC" "$HTTP" "$QUERY" "$QUERY_GRPC" "$HEALTH" "$MAX_TRACES" "$START_TIMEOUT"; do
  [[ "$p" =~ ^[0-9]+$ ]] || die "ports, JAEGER_MAX_TRACES and JAEGER_START_TIMEOUT must be numbers (got $p)"
done
[[ "$VERSION" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "JAEGER_VERSION must look like v1.76.0 (got $VERSION)"

# -- fetch -------------------------------------------------------------------
# Built once per version (the binary's presence is the stamp; a failed build leaves none).
fetch() {
  [[ -x "$BIN" ]] && return 0
  command -v go >/dev/null || die "go not found: install the Go toolchain (1.24+) to build Jaeger"
  echo "jaeger.sh: building $MODULE/cmd/jaeger@$VERSION into $BIN (several minutes)" >&2
  local dir
  dir="$(cd /tmp && go mod download -json "$MODULE@$VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  [[ -n "$dir" && -d "$dir/cmd/jaeger" ]] || die "go mod download $MODULE@$VERSION gave no source folder"
  mkdir -p "$CACHE"
  (cd "$dir" && nice -n 19 go build -trimpath -ldflags "-s -w" -o "$BIN.tmp" ./cmd/jaeger)
  mv "$BIN.tmp" "$BIN"
}

# -- start / stop ------------------------------------------------------------
write_config() {
  mkdir -p "$DATA"
  local ui=""
  if [[ -n "$UI_ASSETS" ]]; then
    [[ -f "$UI_ASSETS/index.html" ]] || die "JAEGER_UI_ASSETS=$UI_ASSETS has no index.html"
    ui="    ui:
      assets_path: $UI_ASSETS"
  fi
  cat >"$DATA/config.yaml" <<EOF
# written by deploy/jaeger/jaeger.sh: in-memory storage, OTLP in, every port on $HOST
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    resource:
      service.name: jaeger
    metrics:
      level: none
    logs:
      level: info
extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: $HOST:$HEALTH
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: $HOST:$QUERY
    grpc:
      endpoint: $HOST:$QUERY_GRPC
$ui
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: $MAX_TRACES
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: $HOST:$GRPC
      http:
        endpoint: $HOST:$HTTP
processors:
  batch:
    timeout: 200ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
EOF
}

# A pid counts only while it is a jaeger started with this config (pids get reused).
running_pid() {
  local pid
  [[ -f "$DATA/jaeger.pid" ]] || return 1
  pid="$(cat "$DATA/jaeger.pid")"
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null &&
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$DATA/config.yaml" || return 1
  echo "$pid"
}

start() {
  fetch
  if running_pid >/dev/null; then
    echo "jaeger.sh: already running" >&2
    return 0
  fi
  write_config
  nohup "$BIN" --config "$DATA/config.yaml" >"$DATA/jaeger.log" 2>&1 &
  echo $! >"$DATA/jaeger.pid"
  local deadline=$((SECONDS + START_TIMEOUT))
  until curl -fsS "http://$HOST:$QUERY/api/services" >/dev/null 2>&1; do
    if ! running_pid >/dev/null; then
      tail -20 "$DATA/jaeger.log" >&2
      die "jaeger exited during start (log: $DATA/jaeger.log)"
    fi
    ((SECONDS < deadline)) || die "not ready after ${START_TIMEOUT}s (log: $DATA/jaeger.log)"
    sleep 0.2
  done
  echo "jaeger.sh: ready: OTLP grpc $HOST:$GRPC, http $HOST:$HTTP; query http://$HOST:$QUERY" >&2
}

stop() {
  local pid
  if ! pid="$(running_pid)"; then
    rm -f "$DATA/jaeger.pid"
    echo "jaeger.sh: not running"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  rm -f "$DATA/jaeger.pid"
  echo "jaeger.sh: stopped"
}

status() {
  local pid
  if pid="$(running_pid)"; then
    echo "jaeger: running (pid $pid); query http://$HOST:$QUERY"
  else
    echo "jaeger: stopped"
    return 3
  fi
}

case "${1:-}" in
  fetch) fetch ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 fetch|start|stop|status" >&2; exit 2 ;;
esac
