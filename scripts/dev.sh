#!/usr/bin/env bash
# Creates (or reuses) .venv with a Python >= 3.12 found on this machine, installs the project
# with its test and notebook extras (plus the cuda extra for test --gpu), then runs:
#   demo [args]                   python -m jax_sparse_mla demo
#   test [pytest args]            the suite on the CPU (Pallas kernels in interpret mode), on two
#                                 pytest-xdist workers where xdist is installed, XLA's CPU backend
#                                 at optimisation level 0 (faster compiles)
#   test --gpu [pytest args]      the cuda extra (CUDA_EXTRA=cuda13 or cuda12), then every test,
#                                 `gpu`-marked ones included; fails if jax sees no GPU
# --no-install (after the command) skips .venv and pip: the Python found runs as it is, for a
# machine whose environment already holds the dependencies (an offline GPU runner, an engine's).
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local candidates=() v
  [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
  candidates+=(python3 python3.13 python3.12)
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | sort -V -r); do
      candidates+=("$(pyenv root)/versions/$v/bin/python")
    done
  fi
  for py in "${candidates[@]}"; do
    if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
      command -v "$py" || echo "$py"
      return 0
    fi
  done
  echo "no Python >= 3.12 found: install one or set PYTHON=/path/to/python3.12" >&2
  return 1
}

cmd=${1:-}; shift || true
gpu=0; install=1; args=()
for a in "$@"; do
  case "$a" in
    --gpu) gpu=1 ;;
    --no-install) install=0 ;;
    *) args+=("$a") ;;
  esac
done
[ "$gpu" = 1 ] && [ "$cmd" != test ] && { echo "--gpu goes with test" >&2; exit 2; }

if [ "$install" = 1 ]; then
  if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
    rm -rf .venv
    "$(find_python)" -m venv .venv
  fi
  extras=test,notebook  # notebook: tests/test_notebook.py runs in CI too
  [ "$gpu" = 1 ] && extras="${CUDA_EXTRA:-cuda13},$extras"
  # the stamp changes with pyproject, the extras and the version (the installed metadata holds it)
  stamp=.venv/.installed-$(cat pyproject.toml <(echo "$extras") <(grep -m1 "^__version__" jax_sparse_mla/__init__.py) | sha1sum | cut -c1-12)
  if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[$extras]"
    rm -f .venv/.installed-*; touch "$stamp"
  fi
  py=.venv/bin/python
else
  py=$(find_python)
fi

case "$cmd" in
  demo) exec "$py" -m jax_sparse_mla demo "${args[@]}" ;;
  test)
    if [ "$gpu" = 1 ]; then
      "$py" -c 'import jax, sys; b = jax.default_backend(); print("jax", jax.__version__, "backend", b, jax.devices()); sys.exit(b != "gpu")' \
        || { echo "test --gpu: jax sees no GPU (is the cuda extra's driver/toolkit usable here?)" >&2; exit 1; }
      exec "$py" -m pytest -q -m "gpu or not gpu" "${args[@]}"
    fi
    workers=()
    "$py" -c 'import xdist' >/dev/null 2>&1 && workers=(-n 2 --dist worksteal)  # the CI machine has 2 cores (README)
    # XLA's CPU compiles dominate the suite: LLVM at -O0 compiles them faster, and the programs it
    # makes (interpreted kernels included) still run the suite faster than -O2's
    export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0"
    exec "$py" -m pytest -q "${workers[@]}" "${args[@]}" ;;
  *) echo "usage: scripts/dev.sh demo [--config tiny|deepseek_v32] [--force] | test [--gpu] [pytest args]   (--no-install: use the Python found as is)" >&2; exit 2 ;;
esac
