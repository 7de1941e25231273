"""Helpers shared by the tests and the scripts, kept out of the wheel: the float64 reference model, HLO counting,
the benchmarks' command-line helpers, the tpu-inference wheel, fakes of what the runner hands the model, the
KV-cache manager's checks and parameter checks. Importable as `support` with `tests/` on `sys.path` (pytest's
`pythonpath`, the upstream tier's pytest.ini, one line at the top of each script); the runtime never imports it
(`tests/unit/support/runtime_imports_test.py`)."""
