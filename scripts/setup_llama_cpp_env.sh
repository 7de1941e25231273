#!/usr/bin/env bash
# Builds (once) the llama.cpp peer's venv for scripts/benchmark_decode.py: llama-cpp-python==0.3.36 from PyPI,
# which compiles llama.cpp for this CPU (a few minutes the first time), and prints its interpreter's path on
# stdout. Safe to re-run: a venv whose install finished is reused; one whose install did not finish is rebuilt.
#
#   MAXTEXT_LLAMA_CPP_VENV  where the venv lives (default ~/.cache/maxtext/llama-cpp-python-0.3.36)
#   PYTHON3                 the Python (3.9 or newer) to build it with (default: python3 on PATH)
#   CMAKE_BUILD_PARALLEL_LEVEL  compile jobs (default 2: the build shares the machine)
#
# Exits 3 with one line on stderr when no usable Python is found, 1 with one line when the build fails (pip's
# log is kept next to the venv).
set -euo pipefail
venv=${MAXTEXT_LLAMA_CPP_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/maxtext/llama-cpp-python-0.3.36}
requirement=llama-cpp-python==0.3.36
python3=${PYTHON3:-$(command -v python3 || true)}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}

if [ ! -f "$venv/.maxtext-complete" ]; then
  if [ -z "$python3" ] || ! "$python3" -c 'import sys; assert sys.version_info[:2] >= (3, 9)' 2>/dev/null; then
    echo "llama.cpp peer: no Python 3.9+ found (set \$PYTHON3 or put python3 on PATH; got '${python3}')" >&2
    exit 3
  fi
  log="$venv.build.log"
  echo "llama.cpp peer: building $venv with $python3 ($requirement compiles llama.cpp; a few minutes)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python3" -m venv "$venv"
  if ! { "$venv/bin/python" -m pip install --upgrade pip && \
         "$venv/bin/python" -m pip install --no-cache-dir "$requirement"; } >"$log" 2>&1; then
    echo "llama.cpp peer: pip install $requirement failed (needs cmake and a C++ compiler); see $log" >&2
    exit 1
  fi
  "$venv/bin/python" -c 'import llama_cpp' >>"$log" 2>&1 || {
    echo "llama.cpp peer: $requirement installed but 'import llama_cpp' fails; see $log" >&2
    exit 1
  }
  touch "$venv/.maxtext-complete"
fi
echo "$venv/bin/python"
