#!/usr/bin/env bash
# The upstream tier: vLLM 0.32.0 + tpu-inference 0.32.0's real runner drives MaxTextForCausalLM on the CPU
# (tests/upstream). Builds its venv first (scripts/setup_upstream_env.sh); extra arguments go to pytest.
# Without Python 3.12 it says so in one line and exits 0, except under CI (CI=true), where that is a failure.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
status=0
python=$(bash "$repo/scripts/setup_upstream_env.sh") || status=$?
if [ "$status" -eq 3 ]; then
  if [ "${CI:-}" = "true" ]; then
    echo "upstream tier: failed: CI must run it and no Python 3.12 was found" >&2
    exit 1
  fi
  echo "upstream tier: skipped (no Python 3.12)" >&2
  exit 0
fi
[ "$status" -eq 0 ] || exit "$status"
cd "$repo"
export MAXTEXT_MAIN_PYTHON=${MAXTEXT_MAIN_PYTHON:-$repo/.venv/bin/python}
"$python" -m pytest -c tests/upstream/pytest.ini tests/upstream "$@"
# The main suite's tests of the runner-facing code, with vLLM and tpu-inference installed (they must not assume
# either is absent).
"$python" -m pytest -q -p no:cacheprovider -m "not slow and not hf" tests/unit/integration tests/unit/decode_test.py \
  tests/unit/support tests/unit/kernels/attention_metadata_test.py tests/unit/models/sharding_test.py
