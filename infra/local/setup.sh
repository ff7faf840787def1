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
