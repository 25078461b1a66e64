#!/usr/bin/env bash
# SeaweedFS (Apache-2.0) as the S3-compatible object storage of tests and local deployments.
#   weed.sh fetch   build the pinned `weed` from the Go module proxy into .cache/seaweedfs/ (once)
#   weed.sh path    print where the binary is
# `go install module@version` refuses SeaweedFS (its go.mod has replace directives), so the pinned
# module is downloaded with `go mod download` and built from the module cache with its own go.mod.
# The tests start and stop the server themselves (tests/s3_support.py); by hand:
#   $(deploy/seaweedfs/weed.sh path) server -dir=/tmp/weed -ip=127.0.0.1 -s3 -s3.port=8333
set -euo pipefail
VERSION="${SEAWEEDFS_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}"  # master of 2026-11-09
MODULE=github.com/seaweedfs/seaweedfs
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
CACHE="${DAGFOLD_CACHE:-$ROOT/.cache}/seaweedfs"
BIN="$CACHE/weed-$VERSION"

case "${1:-}" in
  path) echo "$BIN" ;;
  fetch)
    if [ -x "$BIN" ]; then exit 0; fi
    command -v go >/dev/null || { echo "weed.sh: Go is needed to build SeaweedFS" >&2; exit 1; }
    mkdir -p "$CACHE"
    dir="$(cd /tmp && go mod download -json "$MODULE@$VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    [ -n "$dir" ] || { echo "weed.sh: cannot download $MODULE@$VERSION" >&2; exit 1; }
    echo "weed.sh: building SeaweedFS $VERSION (several minutes the first time)" >&2
    (cd "$dir" && go build -o "$BIN.part" ./weed)
    mv "$BIN.part" "$BIN"
    ;;
  *) echo "usage: $0 fetch|path" >&2; exit 2 ;;
esac
