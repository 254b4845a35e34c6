"""Hugging Face checkpoints against transformers' own models on the same weights, family by
family: tiny random models built and saved with transformers (tests/hf_checkpoints.py), loaded
by `flax_mha.models.hf` from safetensors, compared on logits (right- and left-padded batches, at
the positions transformers derives), on greedy tokens through `decoding.generate` and
`serving.serve` against transformers' `generate` (past the sliding windows), sharded and
bfloat16 checkpoints, a device mesh, the command line, and without torch on the loader's path.
Integration: importing torch and transformers takes ~10 s. The refusals and the config
presets without transformers: tests/models/test_hf.py.

Dimension key: B batch, L length, C vocabulary.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_checkpoints as hc
from experiments import generate_hf
from flax_mha import serving
from flax_mha.models import decoding, hf, speculative
from tests.multidevice.run import ROOT

import test_hf as unit_cases
from test_hf import llama  # noqa: F401  (the moved case's fixture)

pytestmark = pytest.mark.integration  # torch and transformers: ~10 s to import

# Three prompts: shorter than, about, and past the sliding windows (8) of the tiny models.
PROMPT_LENGTHS = (5, 13, 21)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """family -> a float32 checkpoint directory, built once per module."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  root = tmp_path_factory.mktemp("hf")
  return {family: hc.save_tiny(family, root / family) for family in hc.FAMILIES}


def _prompts(seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, hc.VOCAB_SIZE, n).tolist() for n in PROMPT_LENGTHS]


def _logits(model, variables, tokens, mask, positions):
  """Our logits of a padded batch: padding is its own segment 0, unseen by real tokens."""
  args = tuple(jnp.asarray(a) for a in (tokens, mask, positions))
  return np.asarray(model.apply(variables, *args) if variables is not None else model(*args))


@pytest.mark.parametrize("family", hc.FAMILIES)
def test_logits_equal_transformers(checkpoints, family):
  """Linen and NNX, right- and left-padded: every real token's logits within 1e-4."""
  directory = checkpoints[family]
  linen = hf.load(directory)
  module = hf.load_nnx(directory)
  for pad in (hc.right_padded, hc.left_padded):
    tokens, mask, positions = pad(_prompts())
    want = hc.hf_logits(directory, tokens, mask, positions)
    real = mask.astype(bool)
    for model, variables in (linen, (module, None)):
      got = _logits(model, variables, tokens, mask, positions)
      np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0,
                                 err_msg=f"{family} {pad.__name__}")


def _hf_cached_greedy(directory, prompt: list[int], new: int) -> list[int]:
  """transformers' model called step by step through its cache (greedy), without generate:
  Phi-3's generate recomputes its whole cache once where the sequence passes the original
  context, which flax_mha's caches do not (docs/hf.md)."""
  import torch
  model = hc._load(directory)  # pylint: disable=protected-access
  with torch.no_grad():
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(new):
      tokens.append(int(out.logits[0, -1].argmax()))
      out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
  return tokens


def test_phi3_longrope_turns_long_past_its_original_context_as_transformers_does(checkpoints):
  """The tiny Phi-3's LongRoPE (an original context of 40 tokens; the family tests stay within
  it): logits of 45-token sequences take the long factors; a 36-token prompt's greedy
  continuation passes from short to long factors at its 41st position, the keys cached before
  it kept, as transformers' model stepped through its cache does; the serving loop, which
  prefills in pieces, refuses a prompt past the original context by name."""
  directory = checkpoints["phi3"]
  model, variables = hf.load(directory)
  rng = np.random.default_rng(3)
  tokens, mask, positions = hc.right_padded(rng.integers(3, hc.VOCAB_SIZE, (2, 45)).tolist())
  want = hc.hf_logits(directory, tokens, mask, positions)
  np.testing.assert_allclose(_logits(model, variables, tokens, mask, positions), want,
                             atol=1e-4, rtol=0)
  prompt = rng.integers(3, hc.VOCAB_SIZE, 36).tolist()
  rows = np.array([prompt], np.int32)
  got = decoding.generate(model, variables, (rows,), rows, max_new_tokens=10)
  assert np.asarray(got)[0].tolist() == _hf_cached_greedy(directory, prompt, 10)
  with pytest.raises(ValueError, match=r"a prompt of 45 tokens passes this model's LongRoPE "
                                       r"original context \(40 tokens\)"):
    serving.serve(model, variables, tokens.tolist(), 2, batch_size=2, page_size=8,
                  num_pages=32)


@pytest.mark.parametrize("family", hc.ci_families())
def test_greedy_tokens_equal_transformers_generate(checkpoints, family):
  """decoding.generate (linen and NNX) and serving.serve give transformers' greedy tokens,
  12 new tokens after prompts of 5 to 21 (past the windows of 8: rolling caches)."""
  directory = checkpoints[family]
  prompts = _prompts(1)
  want = hc.hf_generate(directory, prompts, NEW_TOKENS)
  padded, _, _ = hc.right_padded(prompts)
  lengths = np.array(PROMPT_LENGTHS, np.int32)
  model, variables = hf.load(directory)
  for decoder, params in ((model, variables), (hf.load_nnx(directory), None)):
    got = decoding.generate(decoder, params, (padded,), padded, lengths,
                            max_new_tokens=NEW_TOKENS)
    assert np.asarray(got).tolist() == want, family
  served, _ = serving.serve(model, variables, prompts, NEW_TOKENS, batch_size=2, page_size=8,
                            num_pages=2 * 5, prefill_chunk=8)
  assert served == want, family


def _speculative_case(checkpoints, family, nnx_draft: bool):
  directory = checkpoints[family]
  rng = np.random.default_rng(2)
  prompts = [np.tile(rng.integers(3, hc.VOCAB_SIZE, 4), n // 4 + 1)[:n].tolist()
             for n in PROMPT_LENGTHS]
  want = hc.hf_generate(directory, prompts, NEW_TOKENS)
  padded, _, _ = hc.right_padded(prompts)
  lengths = np.array(PROMPT_LENGTHS, np.int32)
  if nnx_draft:
    decoder, params = hf.load_nnx(directory), None
    drafter = speculative.DraftModel(*hf.load(checkpoints["qwen2" if family == "llama"
                                                          else "llama"]))
  else:
    (decoder, params), drafter = hf.load(directory), speculative.PromptLookup()
  got, stats = speculative.generate_with_stats(
      decoder, params, (padded,), padded, lengths, max_new_tokens=NEW_TOKENS, drafter=drafter,
      num_speculative_tokens=3)
  assert np.asarray(got).tolist() == want, (family, type(drafter).__name__)
  assert stats.rounds < NEW_TOKENS


@pytest.mark.parametrize("family", hc.ci_families(("llama", "gemma3", "gpt_oss")))
def test_speculative_greedy_tokens_equal_transformers_generate(checkpoints, family):
  """speculative.generate's greedy tokens (prompt lookup, linen) are transformers'
  `generate`'s, on prompts that repeat themselves (drafts kept), past the windows."""
  _speculative_case(checkpoints, family, nnx_draft=False)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_speculative_with_a_draft_checkpoint_in_nnx(checkpoints, family):
  """The NNX model with another family's checkpoint as its draft model (the tiny checkpoints
  share one tokenizer): transformers' greedy tokens, with drafts kept."""
  _speculative_case(checkpoints, family, nnx_draft=True)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_sharded_checkpoint_loads_as_the_whole(checkpoints, family, tmp_path):
  """Shards with their index load to the very parameters of the single file."""
  directory = hc.save_tiny(family, tmp_path / family, max_shard_size="20KB")
  assert (directory / "model.safetensors.index.json").is_file()
  assert len(hf.tensor_files(directory)) > 2
  _, whole = hf.load(checkpoints[family])
  _, sharded = hf.load(directory)
  jax.tree.map(np.testing.assert_array_equal, sharded, whole)


@pytest.mark.parametrize("family", hc.ci_families(("llama", "gemma3", "gpt_oss")))
def test_a_bfloat16_checkpoint_stays_bfloat16(family, tmp_path):
  """A bf16 checkpoint loads as bf16 (params and logits' inputs); asked for float32 it matches
  transformers' float32 run of the same bf16 weights to 1e-4. Its bf16 logits (products
  accumulating in float32, flax_mha.precision) lie within 4% of the largest float32 logit of
  our float32 ones and 8% of transformers' bf16 ones (a mixture of experts: at 90% of the
  tokens), whose argmax they share at >= 90% of the positions (bf16 has 8 bits of mantissa; the same comparison on a 124M model:
  `python -m experiments.bench.hf --part numerics`)."""
  directory = hc.save_tiny(family, tmp_path / family, dtype="bfloat16")
  model, variables = hf.load(directory)
  dtypes = {jax.tree_util.keystr(path): leaf.dtype
            for path, leaf in jax.tree_util.tree_leaves_with_path(variables)}
  # DeepSeek's router correction stays float32, as transformers keeps it.
  bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
  assert {d for p, d in dtypes.items() if "correction_bias" not in p} == {bf16}
  assert {d for p, d in dtypes.items() if "correction_bias" in p} <= {f32}
  assert model.config.dtype == jnp.bfloat16
  tokens, mask, positions = hc.left_padded(_prompts())
  want = hc.hf_logits(directory, tokens, mask, positions)  # float32 compute of bf16 weights
  real = mask.astype(bool)
  model32, variables32 = hf.load(directory, dtype=jnp.float32)
  got32 = _logits(model32, variables32, tokens, mask, positions)[real]
  np.testing.assert_allclose(got32, want[real], atol=1e-4, rtol=0)
  got16 = _logits(model, variables, tokens, mask, positions)[real]
  theirs16 = hc.hf_logits(directory, tokens, mask, positions, dtype="bfloat16")[real]
  scale = np.abs(got32).max()
  # A mixture of experts whose router is near a tie at a token may pick another expert there
  # in bf16 (ours or transformers', each rounding its own way): 1 in 10 such tokens allowed.
  allowed = 0.1 if model.config.moe is not None else 0.0
  for other, tolerance in ((got32, 0.04), (theirs16, 0.08)):
    off = (np.abs(got16 - other).max(-1) > tolerance * scale).mean()
    assert off <= allowed, (off, np.abs(got16 - other).max(-1) / scale)
  agree = (got16.argmax(-1) == theirs16.argmax(-1)).mean()
  assert agree >= 0.9, agree


def test_glm4_moe_skips_its_multi_token_prediction_layers(checkpoints, tmp_path):
  """A GLM-4.5 checkpoint holds its multi-token prediction layer as model.layers.{L}, past the
  model's L layers: skipped on load, as transformers skips it."""
  import shutil
  from safetensors.numpy import load_file, save_file
  directory = tmp_path / "glm4_moe"
  shutil.copytree(checkpoints["glm4_moe"], directory)
  tensors = load_file(directory / "model.safetensors")
  tensors["model.layers.3.eh_proj.weight"] = np.ones((64, 128), np.float32)
  tensors["model.layers.3.mlp.gate.weight"] = np.ones((8, 64), np.float32)
  save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
  jax.tree.map(np.testing.assert_array_equal, hf.load(directory)[1],
               hf.load(checkpoints["glm4_moe"])[1])


def test_the_loader_never_imports_torch(checkpoints):
  """Loading, generating and tokenizing in a fresh interpreter leave torch and transformers
  unimported."""
  code = f"""
import sys
import numpy as np
from flax_mha.models import decoding, hf, speculative
model, variables = hf.load({str(checkpoints['llama'])!r})
module = hf.load_nnx({str(checkpoints['gemma3'])!r})
ids = hf.load_tokenizer({str(checkpoints['llama'])!r}).encode("the cat").ids
prompt = np.array([ids], np.int32)
decoding.generate(model, variables, (prompt,), prompt, max_new_tokens=2)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
assert not leaked, leaked
print("clean")
"""
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
  assert result.returncode == 0 and "clean" in result.stdout, result.stderr[-3000:]


def test_loading_onto_a_mesh_places_each_parameter(checkpoints):
  """On 8 emulated devices (data 2 x model 4), the loaded params carry the model's shardings
  (query heads split over 'model') and the logits equal the single-device ones."""
  code = f"""
import jax, jax.numpy as jnp, numpy as np
from flax_mha.parallel import sharding
from flax_mha.models import hf
directory = {str(checkpoints['llama'])!r}
mesh = sharding.make_mesh(data=2, model=4)
model, placed = hf.load(directory, mesh=mesh)
query = placed["params"]["block_0"]["attention"]["query"]["kernel"]
assert query.sharding.spec[1] == "model", query.sharding
assert len(query.sharding.device_set) == 8
_, single = hf.load(directory)
tokens = jnp.arange(3, 19)[None]
np.testing.assert_allclose(model.apply(placed, tokens), model.apply(single, tokens), atol=1e-5)
print("OK")
"""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
  assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("serve", [False, True])
def test_the_command_line_decodes_the_text_of_transformers(checkpoints, serve):
  """experiments.generate --checkpoint prints each prompt's continuation: transformers' greedy
  tokens up to its first end-of-sequence id, decoded by the same tokenizer."""
  directory = checkpoints["qwen2"]
  tokenizer = hf.load_tokenizer(directory)
  texts = ["the quick cat", "a dog sat on the warm mat and"]
  want = []
  for text in texts:
    (tokens,) = hc.hf_generate(directory, [tokenizer.encode(text).ids], NEW_TOKENS)
    want.append(tokenizer.decode(serving.until_stop(tokens, hf.stop_tokens(directory)),
                                 skip_special_tokens=True))
  out = io.StringIO()
  got = generate_hf.generate(str(directory), texts, max_new_tokens=NEW_TOKENS, serve=serve,
                             batch_size=2, page_size=8, out=out)
  assert got == want
  lines = out.getvalue().split("\n")  # random tokens decode to any character: no splitlines
  assert lines[:2] == [t + w for t, w in zip(texts, want)]
  assert "tokens/s" in lines[2]
  if not serve:  # the module's command line once: a process of its own
    result = subprocess.run(
        [sys.executable, "-m", "experiments.generate", "--checkpoint", str(directory),
         "--prompt", texts[0], "--max_new_tokens", str(NEW_TOKENS)],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[0] == texts[0] + want[0]


# Moved from the unit part for its time (4 s).
test_float64_loads_only_under_x64 = unit_cases.check_float64_loads_only_under_x64
