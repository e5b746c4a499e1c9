#!/usr/bin/env bash
# Load benchmark of the webhook door beside a bare axum server, in one invocation.
# Installs wrk (Debian package) when missing, then runs the `load` bench target, which
# prints a Markdown table (events/s, p50/p99, non-2xx, CPU per request, ratio to the bare server).
# Environment: LOAD_SECS, LOAD_ROUNDS, LOAD_CONNECTIONS, LOAD_THREADS, LOAD_FLOOR, LOAD_KEYED, LOAD_BENCH_DIR (see load.rs).
set -euo pipefail
cd "$(dirname "$0")/../../.."
if ! command -v wrk >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq wrk; else sudo apt-get update -qq && sudo apt-get install -y -qq wrk; fi
fi
exec cargo bench -p iggy-ingest --bench load
