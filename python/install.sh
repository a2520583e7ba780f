#!/usr/bin/env bash
# Builds flumen's Python module (`python/`) with maturin into target/test-venv, the
# interpreter the tests' Python tools live in, and installs what its tests use (pytest,
# pyarrow, polars, numpy, cloudpickle). The build shares the repository's target directory
# and dev profile (`python` is a member of the root's workspace), and with the feature
# `share-test-build` it reuses the crates `cargo test --no-run` built (python/Cargo.toml).
# A user installs the package with `pip install ./python` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$PWD/target/test-venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "maturin>=1.5,<2" pytest "pyarrow>=15" polars numpy cloudpickle
started=$(date +%s)
VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    "$venv/bin/maturin" develop --quiet --features share-test-build --manifest-path python/Cargo.toml
took=$(($(date +%s) - started))
"$venv/bin/python" -c "import flumen; print('flumen Python module built into', '$venv', 'in $took s')"
if [ "$took" -gt 180 ]; then
    echo "note: the module took $took s: it compiled crates that \`cargo test\` had built with other"
    echo "      features; bring python/Cargo.toml's share-test-build in step with the root's dependencies"
fi
