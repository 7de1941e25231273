#!/usr/bin/env bash
# Builds (once) the llama.cpp peer's venv for scripts/benchmark_decode.py: llama-cpp-python==0.3.36 from PyPI,
# which compiles llama.cpp for this CPU (a few minutes the first time), and prints its interpreter's path on
# stdout. Safe to re-run: a venv whose install finished is reused; one whose install did not finish is rebuilt.
#
#   MAXTEXT_LLAMA_CPP_VENV  where the venv lives (default ~/.cache/maxtext/llama-cpp-python-0.3.36)
#   PYTHON3                 the Python (3.9 or newer) to build it with (default: python3 on PATH)
#   CMAKE_BUILD_PARALLEL_LEVEL  compile jobs (default 2: the build shares the machine)
#   CMAKE_ARGS              llama.cpp's build options (default: see below)
#   MAXTEXT_CPUINFO         the CPU description read for them (default /proc/cpuinfo)
#
# On a CPU with AMX, llama.cpp's native build (-march=native) stores quantized weights in its AMX buffer type, which
# crashes (SIGSEGV) while repacking SmolLM2's Q4_1 weights (llama-cpp-python 0.3.36). There the build names the x86
# extensions the CPU has instead, without AMX. The options a venv was built with are kept in its completion marker:
# a venv built with other options is rebuilt.
#
# Exits 3 with one line on stderr when no usable Python is found, 1 with one line when the build fails (pip's
# log is kept next to the venv).
set -euo pipefail
venv=${MAXTEXT_LLAMA_CPP_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/maxtext/llama-cpp-python-0.3.36}
requirement=llama-cpp-python==0.3.36
python3=${PYTHON3:-$(command -v python3 || true)}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}

# The build options for this CPU: none (llama.cpp's native build) unless it has AMX.
default_cmake_args() {
  local flags pair args="-DGGML_NATIVE=OFF"
  flags=" $(grep -m1 '^flags' "${MAXTEXT_CPUINFO:-/proc/cpuinfo}" 2>/dev/null | cut -d: -f2) "
  case "$flags" in *" amx_tile "*) ;; *) return 0 ;; esac
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 avx512vbmi:AVX512_VBMI \
    avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    case "$flags" in *" ${pair%%:*} "*) args+=" -DGGML_${pair#*:}=ON" ;; *) args+=" -DGGML_${pair#*:}=OFF" ;; esac
  done
  echo "$args"
}
export CMAKE_ARGS=${CMAKE_ARGS-$(default_cmake_args)}

if [ ! -f "$venv/.maxtext-complete" ] || [ "$(cat "$venv/.maxtext-complete")" != "$CMAKE_ARGS" ]; then
  if [ -z "$python3" ] || ! "$python3" -c 'import sys; assert sys.version_info[:2] >= (3, 9)' 2>/dev/null; then
    echo "llama.cpp peer: no Python 3.9+ found (set \$PYTHON3 or put python3 on PATH; got '${python3}')" >&2
    exit 3
  fi
  log="$venv.build.log"
  echo "llama.cpp peer: building $venv with $python3 ($requirement compiles llama.cpp${CMAKE_ARGS:+ with $CMAKE_ARGS}; a few minutes)" >&2
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
  printf '%s' "$CMAKE_ARGS" >"$venv/.maxtext-complete"
fi
echo "$venv/bin/python"
