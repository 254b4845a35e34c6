"""The package: the front ends and models load on first access under the names the README
shows; the runtime dependencies are what flax_mha imports. The fresh interpreter and the wheel
are in tests/test_package_integration.py."""

import ast
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

import flax_mha
from tests.multidevice.run import ROOT


def test_lazy_names_are_the_front_ends_and_models():
  """The names that load on first access are the objects of the modules that define them."""
  from flax_mha.models import lm, transformer  # pylint: disable=import-outside-toplevel
  from flax_mha.nn import linen, nnx  # pylint: disable=import-outside-toplevel
  assert flax_mha.nnx is nnx and flax_mha.linen is linen
  assert flax_mha.MultiHeadAttention is linen.MultiHeadAttention
  assert flax_mha.SelfAttention is linen.SelfAttention
  assert flax_mha.Transformer is transformer.Transformer
  assert flax_mha.TransformerConfig is transformer.TransformerConfig
  assert flax_mha.DecoderLM is lm.DecoderLM and flax_mha.LMConfig is lm.LMConfig
  assert flax_mha.greedy_decode is transformer.greedy_decode
  assert flax_mha.beam_search is transformer.beam_search
  assert {"MultiHeadAttention", "nnx", "Transformer"} <= set(dir(flax_mha))
  with pytest.raises(AttributeError, match="module 'flax_mha' has no attribute 'Nope'"):
    flax_mha.Nope  # pylint: disable=pointless-statement


def test_the_dependencies_are_what_the_library_imports():
  """pyproject's [project] dependencies name jax, jaxlib and flax, and flax_mha imports nothing
  else outside the standard library (numpy comes with jax; jaxlib is what jax runs on), but for
  the Hugging Face loader, which imports its own extra. Optax, ml_collections and chex are the
  experiments' and the tests' (their extras). The HTTP server (flax_mha/serving/http/) imports
  its own extra, `http`."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
  declared = {re.match(r"[A-Za-z0-9_.-]+", d).group(0) for d in project["dependencies"]}
  assert declared == {"jax", "jaxlib", "flax"}, declared
  # The Hugging Face loader alone also imports its extra, `hf` (safetensors, tokenizers).
  hf_extra = {re.match(r"[A-Za-z0-9_.-]+", d).group(0)
              for d in project["optional-dependencies"]["hf"]}
  assert hf_extra == {"safetensors", "tokenizers"}, hf_extra
  http_extra = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).replace("-", "_")
                for d in project["optional-dependencies"]["http"]}
  everything = set()
  for path in (ROOT / "flax_mha").rglob("*.py"):
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.Import):
        imported.update(alias.name.split(".")[0] for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"flax_mha"}
    allowed = {"jax", "flax", "numpy"} | (hf_extra if path.name == "hf.py" else set())
    allowed |= http_extra if path.parent.name == "http" else set()
    assert third_party <= allowed, (path, third_party - allowed)
    everything |= third_party
  assert everything == {"jax", "flax", "numpy"} | hf_extra | http_extra, everything


@pytest.mark.parametrize("module, absent", [
    ("flax_mha.models.lm_config", ("flax", "flax_mha.models.lm", "flax_mha.nn.linen")),
    ("flax_mha.models.hf_config", ("flax", "flax_mha.models.lm", "flax_mha.nn.linen")),
    # flax.nnx itself loads flax.linen; the NNX LM loads none of flax_mha's linen modules.
    ("flax_mha.models.lm_nnx", ("flax_mha.models.lm", "flax_mha.nn.linen")),
    # The HTTP server's extra loads with the server alone, not with serving.
    ("flax_mha.serving", ("fastapi", "uvicorn", "jinja2", "prometheus_client",
                          "flax_mha.serving.http")),
])
def test_the_config_and_the_nnx_model_load_no_linen_model(module, absent):
  """In a fresh interpreter: a config reader loads no flax at all, the NNX LM none of the
  linen modules (LMConfig once lived beside the linen model and loaded it)."""
  code = (f"import sys, {module}; print([m for m in {list(absent)!r} if m in sys.modules])")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=pathlib.Path(__file__).resolve().parents[1])
  assert result.stdout.strip() == "[]", result.stdout
