"""The package: `import flax_mha` and its pure API load no flax; the front ends and models load on
first access under the names the README shows; the wheel holds the library alone and runs the
README's usage example outside the repository."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import flax_mha
from tests.multidevice.run import ROOT


@pytest.mark.integration
def test_the_pure_api_loads_no_flax():
  """`import flax_mha`, a call of dot_product_attention (and explain, masks, mods, rotary,
  sharding): neither flax nor optax is imported; the front ends load on first access."""
  code = """
import sys
import jax.numpy as jnp
import flax_mha
x = jnp.ones((1, 4, 2, 8))
flax_mha.dot_product_attention(x, x, x, is_causal=True, mask_mod=lambda b, h, q, k: q >= k,
                               implementation="chunked")
flax_mha.apply_rotary(x, jnp.arange(4))
flax_mha.explain(x, x, x, local_window_size=2, platform="cuda")
flax_mha.padding_mask(jnp.array([3]), 4)
flax_mha.sharding.make_mesh()
loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('flax', 'optax'))
assert not loaded, loaded
flax_mha.nnx, flax_mha.SelfAttention  # loaded on first access
assert 'flax' in sys.modules
"""
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env=dict(
      os.environ, JAX_PLATFORMS="cpu"))


def test_lazy_names_are_the_front_ends_and_models():
  """The names that load on first access are the objects of the modules that define them."""
  from flax_mha.models import decoding, lm, transformer  # pylint: disable=import-outside-toplevel
  from flax_mha.nn import linen, nnx  # pylint: disable=import-outside-toplevel
  assert flax_mha.nnx is nnx and flax_mha.linen is linen
  assert flax_mha.MultiHeadAttention is linen.MultiHeadAttention
  assert flax_mha.SelfAttention is linen.SelfAttention
  assert flax_mha.Transformer is transformer.Transformer
  assert flax_mha.TransformerConfig is transformer.TransformerConfig
  assert flax_mha.DecoderLM is lm.DecoderLM and flax_mha.LMConfig is lm.LMConfig
  assert flax_mha.greedy_decode is decoding.greedy_decode
  assert flax_mha.beam_search is decoding.beam_search
  assert {"MultiHeadAttention", "nnx", "Transformer"} <= set(dir(flax_mha))
  with pytest.raises(AttributeError, match="module 'flax_mha' has no attribute 'Nope'"):
    flax_mha.Nope  # pylint: disable=pointless-statement


def readme_usage() -> str:
  """The python block under the README's '## Usage' heading."""
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  usage = text[text.index("## Usage"):]
  return re.search(r"```python\n(.*?)```", usage, re.S).group(1)


@pytest.mark.integration
def test_the_wheel_is_the_library_alone(tmp_path):
  """Built offline from a copy of the sources, the wheel holds flax_mha and its metadata only
  (experiments/ and configs/ run from the repository); installed into a folder of its own and
  imported from outside the repository, it runs the README's usage example."""
  source = tmp_path / "source"
  source.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, source / name)
  shutil.copytree(ROOT / "flax_mha", source / "flax_mha",
                  ignore=shutil.ignore_patterns("__pycache__"))
  pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
  subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                  str(tmp_path / "dist"), str(source)], check=True, cwd=tmp_path)
  (wheel,) = (tmp_path / "dist").glob("flax_mha-*.whl")
  tops = {pathlib.PurePosixPath(n).parts[0] for n in zipfile.ZipFile(wheel).namelist()}
  assert {t for t in tops if not t.endswith(".dist-info")} == {"flax_mha"}, tops
  site = tmp_path / "site"
  subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                 check=True, cwd=tmp_path)
  code = f"""
import importlib.util, pathlib
import flax_mha
assert pathlib.Path(flax_mha.__file__).is_relative_to({str(site)!r}), flax_mha.__file__
assert importlib.util.find_spec("experiments") is None
assert importlib.util.find_spec("configs") is None
{readme_usage()}
assert out.shape == (2, 64, 8, 16) and y.shape == (2, 64, 128)
"""
  subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True,
                 env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(site)))
