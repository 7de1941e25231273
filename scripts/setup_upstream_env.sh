#!/usr/bin/env bash
# Builds (once) the upstream tier's venv: Python 3.12 with vllm-tpu==0.32.0 (vLLM 0.32.0, tpu-inference 0.32.0,
# jax 0.11.2; about 7 minutes and 11 GB the first time), pytest and this repository (editable, no other deps), and
# prints its interpreter's path on stdout. Safe to re-run: a venv whose install finished is reused; one whose
# install did not finish is rebuilt; this repository is re-installed every time (a few seconds).
#
#   MAXTEXT_UPSTREAM_VENV  where the venv lives (default ~/.cache/maxtext/upstream-vllm-tpu-0.32.0)
#   PYTHON312              the Python 3.12 interpreter to build it with (default: python3.12 on PATH, then pyenv's)
#
# Exits 3 with one line on stderr when no Python 3.12 is found (the tier's runner reports that as a skip).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${MAXTEXT_UPSTREAM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/maxtext/upstream-vllm-tpu-0.32.0}
requirements=(vllm-tpu==0.32.0 "pytest>=8.0" "ml-collections>=1.0.0")

find_python312() {
  local candidate
  for candidate in "${PYTHON312:-}" "$(command -v python3.12 2>/dev/null || true)"; do
    # A pyenv shim is on PATH even when 3.12 is not the selected version; it fails when run, so run it.
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  local root
  root=$( (pyenv root 2>/dev/null) || echo "${PYENV_ROOT:-$HOME/.pyenv}")
  for candidate in $(ls -d "$root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r); do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  return 1
}

if [ ! -f "$venv/.maxtext-complete" ]; then
  python312=$(find_python312) || {
    echo "upstream tier: no Python 3.12 found (python3.12 on PATH, \$PYTHON312, or pyenv's versions/3.12*)" >&2
    exit 3
  }
  echo "upstream tier: building $venv with $python312 (vllm-tpu==0.32.0; several minutes the first time)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python312" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  "$venv/bin/python" -m pip install --quiet "${requirements[@]}" >&2
  touch "$venv/.maxtext-complete"
fi
"$venv/bin/python" -m pip install --quiet --no-deps -e "$repo" >&2
echo "$venv/bin/python"
