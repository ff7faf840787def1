#!/usr/bin/env bash
# Set up this checkout: the virtual environment at .venv with the project and
# its dependencies; with --test also the services the integration tests start
# for real (Debian's clickhouse-server, zookeeper and chromium) and the test extras
# (pytest, playwright's Python driver, CPU PyTorch 2.13.0).
# Idempotent: what is there already is kept.
set -euo pipefail
cd "$(dirname "$0")/../.."

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

py=${PYTHON:-python3}
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "setup: Python >= 3.11 is needed (found: $("$py" --version 2>&1))" >&2
    exit 1
fi

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv" >&2
    "$py" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
fi

if [ $want_test = 1 ]; then
    missing=()
    command -v clickhouse-server >/dev/null 2>&1 || [ -x /usr/sbin/clickhouse-server ] || [ -x /usr/bin/clickhouse-server ] || missing+=(clickhouse-server)
    [ -x /usr/bin/chromium ] || missing+=(chromium)
    # ZooKeeper: the replicated ClickHouse cluster in tests/storage (18.16 has no Keeper of its own).
    [ -x /usr/share/zookeeper/bin/zkServer.sh ] || missing+=(zookeeper)
    # The NCCL profiler plugin's tests build and load it (tests/nccl_plugin).
    command -v gcc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "$(id -u)" = 0 ]; then
            echo "setup: apt-get install ${missing[*]}" >&2
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -qq
            # The packages' own service start-up is not wanted: tests start their own servers.
            printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
            apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
            rm -f /usr/sbin/policy-rc.d
        else
            echo "setup: please install as root: apt-get install ${missing[*]}" >&2
            exit 1
        fi
    fi
    echo "setup: pip install -e .[server,test,train]" >&2
    .venv/bin/python -m pip install -q -e '.[server,test,train]'
else
    echo "setup: pip install -e .[server]" >&2
    .venv/bin/python -m pip install -q -e '.[server]'
fi

# The NCCL profiler plugin (ingest/nccl_profiler/plugin.c), which `stragglerscope trace` arms on CUDA jobs
# for each peer's share of a collective: a shared library built with gcc. A missing gcc is installed as
# the test services are (libc6-dev too: --no-install-recommends leaves out the C headers); without root
# the set-up goes on, and traced NCCL jobs run without per-peer times (the trace says so).
if ! command -v gcc >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        echo "setup: apt-get install gcc libc6-dev" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null
    else
        echo "setup: no gcc, the NCCL profiler plugin is not built (as root: apt-get install gcc libc6-dev)" >&2
    fi
fi
if command -v gcc >/dev/null 2>&1; then
    echo "setup: building the NCCL profiler plugin" >&2
    .venv/bin/python -m ingest.nccl_profiler >/dev/null
fi
