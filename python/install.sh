#!/usr/bin/env bash
# Builds flumen's Python module (`python/`) with maturin into target/test-venv, the
# interpreter the tests' Python tools live in, and installs what its tests use (pytest,
# pyarrow, polars, numpy, cloudpickle). The build shares the repository's target directory
# and dev profile (`python` is a member of the root's workspace), so it reuses the crates
# `cargo test` built. A user installs the package with `pip install ./python` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$PWD/target/test-venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "maturin>=1.5,<2" pytest "pyarrow>=15" polars numpy cloudpickle
VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    "$venv/bin/maturin" develop --quiet --manifest-path python/Cargo.toml
"$venv/bin/python" -c "import flumen; print('flumen Python module built into', '$venv')"
