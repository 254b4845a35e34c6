"""flax_mha.sharding: data, model and data x model layouts equal the unsharded model.

The 8-device checks run in a subprocess (tests/multidevice/check_sharding.py); the table lookups
run here on the single CPU device.
"""

import inspect
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from flax_mha import sharding
from flax_mha.ring_attention import ring_attention
from tests.multidevice.run import ROOT, run_check


@pytest.mark.multidevice
def test_layouts_match_unsharded_on_8_devices():
  lines = run_check("check_sharding.py")
  for name in ("declared specs", "train state", "mha data", "mha model", "mha data_x_model",
               "gqa data_x_model", "ffn data", "ffn model", "ffn data_x_model",
               "transformer_gqa pinned specs", "transformer_gqa data_x_model"):
    assert any(line.startswith(f"OK {name}") for line in lines), (name, lines)


@pytest.mark.parametrize("path, ndim, axes", [
    ("encoder/layer_0/self_attention/query/kernel", 3, ("embed", "heads", "head_dim")),
    ("decoder/layer_1/cross_attention/out/kernel", 3, ("heads", "head_dim", "embed")),
    ("encoder/layer_0/ffn/Dense_0/kernel", 2, ("embed", "mlp")),
    ("encoder/layer_0/ffn/Dense_1/kernel", 2, ("mlp", "embed")),
    ("embed/embedding", 2, ("vocab", "embed")),
    ("encoder/layer_0/ffn_block/norm/scale", 1, (None,)),
    ("opt_state/0/mu/encoder/layer_0/self_attention/value/bias", 2, ("heads", "head_dim")),
    ("opt_state/0/count", 0, ()),
])
def test_logical_axes(path, ndim, axes):
  assert sharding.logical_axes(path, ndim) == axes


def test_single_device_mesh():
  """Size-1 mesh axes divide everything: the same specs, each array whole on the one device."""
  mesh = sharding.make_mesh()
  assert sharding.spec_for(("embed", "heads", "head_dim"), (4, 2, 3), mesh) == P(None, "model",
                                                                               None)
  x = sharding.shard_batch({"src": jax.numpy.ones((3, 5))}, mesh)["src"]
  assert x.sharding.spec == P("data", None) and x.addressable_shards[0].data.shape == (3, 5)


def test_make_mesh_rejects_too_many_devices():
  with pytest.raises(ValueError, match="needs 1024 devices"):
    sharding.make_mesh(data=1024)


def test_mesh_axis_names_have_one_definition():
  """MESH_AXES, the rules and ring attention's defaults all use the same constants."""
  assert sharding.MESH_AXES == (sharding.DATA_AXIS, sharding.MODEL_AXIS, sharding.SEQ_AXIS)
  assert sharding.LOGICAL_RULES["batch"] == sharding.DATA_AXIS
  assert set(sharding.LOGICAL_RULES.values()) <= set(sharding.MESH_AXES)
  default = inspect.signature(ring_attention).parameters["axis_name"].default
  assert default is sharding.SEQ_AXIS
  assert sharding.make_mesh().axis_names == sharding.MESH_AXES


def test_sharding_imports_without_flax():
  """flax_mha.ring_attention imports sharding; the pure-function layer must not pull in flax."""
  code = ("import sys, importlib.util, pathlib\n"
          "spec = importlib.util.spec_from_file_location('s', 'flax_mha/sharding.py')\n"
          "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
          "assert 'flax' not in sys.modules, sorted(m for m in sys.modules if 'flax' in m)\n")
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env=dict(
      os.environ, JAX_PLATFORMS="cpu"))
