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
exec "$python" -m pytest -c tests/upstream/pytest.ini tests/upstream "$@"
