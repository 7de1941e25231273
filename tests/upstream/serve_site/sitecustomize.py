"""Installs the tier's stand-ins in every Python process whose path holds this folder (serve_test.py puts it on the
PYTHONPATH of `vllm serve`): vLLM's API server runs the engine core, and with it tpu-inference's runner, in a child
process of its own, which imports vLLM before any code of the test could run in it."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stand_ins  # pylint: disable=wrong-import-position

stand_ins.install()
# serve_test.py counts these lines: the API server and the engine core must both have the stand-ins.
print(f"stand-ins installed in process {os.getpid()}", file=sys.stderr, flush=True)
