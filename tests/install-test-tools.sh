#!/usr/bin/env bash
# Installs the peer tools the integration tests run against, into target/test-venv (once):
#   moto's S3-compatible server (object-store tests on 127.0.0.1) and the Delta Lake and
#   Iceberg writers of the Python ecosystem (`deltalake`, `pyiceberg`), which write the
#   lakehouse test tables that flumen must read.
# Tests find them there (or through FLUMEN_MOTO_SERVER / FLUMEN_LAKEHOUSE_PYTHON); without
# them those tests print that they were skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$PWD/target/test-venv"
stamp="$venv/.installed-v1"
if [ -e "$stamp" ]; then
    exit 0
fi
# A failed install does not stop the test run: the tests that need these tools then print
# that they were skipped.
if python3 -m venv "$venv" && "$venv/bin/pip" install --quiet --disable-pip-version-check \
    "moto[server]==5.2.5" "deltalake==1.1.4" "pyiceberg[sql-sqlite,pyarrow]==0.12.0"; then
    touch "$stamp"
    echo "test tools installed in $venv"
else
    echo "WARNING: could not install the test tools into $venv:" \
        "the S3, Delta and Iceberg tests will say they were skipped" >&2
fi
