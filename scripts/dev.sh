#!/usr/bin/env bash
# Creates (or reuses) .venv with a Python >= 3.12 found on this machine, installs the project,
# then runs: `demo [args]` (python -m jax_sparse_mla demo) or `test [pytest args]`.
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

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  rm -rf .venv
  "$(find_python)" -m venv .venv
fi
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  rm -f .venv/.installed-*; touch "$stamp"
fi

cmd=${1:-}; shift || true
case "$cmd" in
  demo) exec .venv/bin/python -m jax_sparse_mla demo "$@" ;;
  test) exec .venv/bin/python -m pytest -q "$@" ;;
  *) echo "usage: scripts/dev.sh demo [--config tiny|deepseek_v32] | test [pytest args]" >&2; exit 2 ;;
esac
