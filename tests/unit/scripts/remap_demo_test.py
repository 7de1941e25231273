"""Runs scripts/remap_demo.py in-process so the demo cannot rot."""

import importlib.util
import re
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "remap_demo.py"


def _load_demo():
  spec = importlib.util.spec_from_file_location("remap_demo", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_demo_main_succeeds_and_reports_every_layer(capsys):
  demo = _load_demo()
  assert demo.main() == 0
  out = capsys.readouterr().out
  layer_lines = [line for line in out.splitlines() if re.match(r"layer\.\d+ ", line)]
  assert len(layer_lines) == len(demo.LAYER_KINDS) == 9
  assert all(line.endswith("ok") for line in layer_lines)
  # Recurrent states first: layer.3, the first attention layer, sits after the 6 GDN slots; layer.8 shares slot 7.
  assert re.match(r"layer\.3\s+full_attention\s+6 ", layer_lines[3])
  assert re.match(r"layer\.8\s+full_attention \(KV-shared\)\s+7 ", layer_lines[8])
  assert "kv_caches donated: True" in out
  sizes = re.findall(r"map:\s+(\d+) jaxpr equations, (\d+) HLO instructions", out)
  assert len(sizes) == 2 and sizes[0] == sizes[1]


def test_demo_runner_map_puts_recurrent_states_first():
  demo = _load_demo()
  assert demo.physical_slots(layer_order=False) == (0, 1, 2, 6, 3, 4, 5, 7, 7)
  assert demo.physical_slots(layer_order=True) == (0, 1, 2, 3, 4, 5, 6, 7, 7)
