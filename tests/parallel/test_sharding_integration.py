"""flax_mha.parallel.sharding on 8 emulated devices, in a subprocess (tests/multidevice/check_sharding.py):
data, model and data x model layouts equal the unsharded model (experts split over 'model'
too: expert parallelism). The table lookups are the unit
part, tests/parallel/test_sharding.py, on the single CPU device."""

import pytest

from tests.multidevice.run import run_check

pytestmark = pytest.mark.integration  # a process of 8 emulated devices


@pytest.mark.multidevice
def test_layouts_match_unsharded_on_8_devices():
  lines = run_check("check_sharding.py")
  for name in ("declared specs", "train state", "mha data", "mha model", "mha data_x_model",
               "gqa data_x_model", "ffn data", "ffn model", "ffn data_x_model",
               "transformer_gqa pinned specs", "transformer_gqa data_x_model",
               "experts data_x_model", "experts specs"):
    assert any(line.startswith(f"OK {name}") for line in lines), (name, lines)
