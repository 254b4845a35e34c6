"""The runner's mesh settings that cannot divide the batch or name no strategy are refused
before anything runs. The meshes training as one device are in
tests/test_train_mesh_integration.py."""

import pytest

from experiments import train
from tests.test_train import tiny_config


def check_mesh_must_divide_batch(tmp_path):
  config = tiny_config()
  config.mesh.data = 3
  with pytest.raises(ValueError, match="multiple of mesh.data=3"):
    train.train_and_evaluate(config, str(tmp_path))
  config.mesh.update(data=1, seq=3)
  with pytest.raises(ValueError, match=r"multiples of 6 \(mesh.seq=3, mesh.seq_layout='zigzag'\)"):
    train.train_and_evaluate(config, str(tmp_path))
  config.mesh.update(data=2, fsdp=3, seq=1)
  with pytest.raises(ValueError, match="multiple of mesh.data=2 x mesh.fsdp=3"):
    train.train_and_evaluate(config, str(tmp_path))


@pytest.mark.parametrize("key, value, match", [
    ("seq_strategy", "tree", "strategy must be one of"),
    ("seq_layout", "zig-zag", "layout must be one of")])
def test_sequence_parallel_keys_are_checked(tmp_path, key, value, match):
  config = tiny_config()
  config.mesh[key] = value
  with pytest.raises(ValueError, match=f"config.mesh.seq_strategy / seq_layout: {match}"):
    train.train_and_evaluate(config, str(tmp_path))
