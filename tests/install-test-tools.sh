#!/usr/bin/env bash
# Installs the peer tools the integration tests run against, into target/test-venv (once):
#   moto's S3-compatible server (object-store tests on 127.0.0.1) and the Delta Lake and
#   Iceberg writers of the Python ecosystem (`deltalake`, `pyiceberg`), which write the
#   lakehouse test tables that flumen must read; the ADBC Flight SQL driver (and pyarrow's
#   Flight client), with which `flumen serve`'s tests connect as Python users do; and the `openssl` command, with which the
#   TLS tests make an operator's certificates, and `ip`/`tc` (iproute2) for the multi-host
#   tests' network namespaces (both from Debian's packages when missing).
# Tests find them there (or through FLUMEN_MOTO_SERVER / FLUMEN_LAKEHOUSE_PYTHON).
# Under CI (CI=true) or with FLUMEN_REQUIRE_TOOLS=1 a failed install is an error (exit 1)
# and a test whose tool is missing fails; elsewhere those tests say they were skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
required=0
case "${CI:-}" in "" | 0 | false | FALSE | False) ;; *) required=1 ;; esac
[ "${FLUMEN_REQUIRE_TOOLS:-0}" = "1" ] && required=1
# A Debian package that would not install: an error under CI, a warning elsewhere.
missing_package() {
    if [ "$required" = 1 ]; then
        echo "ERROR: could not install $1: $2" >&2
        exit 1
    fi
    echo "WARNING: could not install $1: $2" >&2
}
if ! command -v openssl >/dev/null; then
    apt-get install -y -qq openssl >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq openssl >/dev/null 2>&1; } \
        || missing_package openssl "the TLS tests will fail"
fi
# The multi-host tests (tests/integration/cluster.rs) make hosts of network namespaces with `ip` and
# shape their links with `tc` (iproute2).
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    apt-get install -y -qq iproute2 >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq iproute2 >/dev/null 2>&1; } \
        || missing_package iproute2 "the multi-host tests will fail"
fi
venv="$PWD/target/test-venv"
stamp="$venv/.installed-v2"
if [ -e "$stamp" ]; then
    exit 0
fi
if python3 -m venv "$venv" && "$venv/bin/pip" install --quiet --disable-pip-version-check \
    "moto[server]==5.2.5" "deltalake==1.1.4" "pyiceberg[sql-sqlite,pyarrow]==0.12.0" \
    "adbc-driver-flightsql==1.13.0" "adbc-driver-manager==1.13.0" "numpy==2.4.6"; then
    touch "$stamp"
    echo "test tools installed in $venv"
elif [ "$required" = 1 ]; then
    echo "ERROR: could not install the test tools into $venv (moto, deltalake, pyiceberg, adbc-driver-flightsql);" \
        "under CI the tests that need them cannot be skipped" >&2
    exit 1
else
    echo "WARNING: could not install the test tools into $venv:" \
        "the S3, Delta and Iceberg tests will say they were skipped" >&2
fi
