"""The package from outside: `import flax_mha` and its pure API load no flax (in a fresh
interpreter); the wheel holds the library alone, asks for jax, jaxlib and flax only, and runs the
README's usage example outside the repository. The unit part is tests/test_package.py."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.multidevice.run import ROOT

pytestmark = pytest.mark.integration  # subprocesses: a fresh interpreter, pip


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
flax_mha.parallel.sharding.make_mesh()
loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('flax', 'optax'))
assert not loaded, loaded
flax_mha.nnx, flax_mha.SelfAttention  # loaded on first access
assert 'flax' in sys.modules
"""
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env=dict(
      os.environ, JAX_PLATFORMS="cpu"))


def readme_usage() -> str:
  """The python block under the README's '## Usage' heading."""
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  usage = text[text.index("## Usage"):]
  return re.search(r"```python\n(.*?)```", usage, re.S).group(1)


def test_the_wheel_is_the_library_alone(tmp_path):
  """Built offline from a copy of the sources, the wheel holds flax_mha and its metadata only
  (experiments/ and configs/ run from the repository) and requires jax, jaxlib and flax alone;
  installed into a folder of its own and imported from outside the repository, it runs the
  README's usage example."""
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
  names = zipfile.ZipFile(wheel).namelist()
  tops = {pathlib.PurePosixPath(n).parts[0] for n in names}
  assert {t for t in tops if not t.endswith(".dist-info")} == {"flax_mha"}, tops
  (metadata,) = (n for n in names if n.endswith(".dist-info/METADATA"))
  requires = [line.removeprefix("Requires-Dist:").strip() for line in zipfile.ZipFile(wheel)
              .read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")]
  runtime = {re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in requires if "extra ==" not in r}
  assert runtime == {"jax", "jaxlib", "flax"}, requires  # optax, chex: the extras' alone
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
