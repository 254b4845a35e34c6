"""flax_mha.rotary's Hugging Face variants against transformers' own rotary code on the same
numbers, family by family (integration: importing transformers takes ~10 s). Against the float64
NumPy reference: the unit part, tests/test_rotary_scaling.py.

Dimension key (flax_mha/__init__.py): B batch, T length, H heads, K head dim.
"""

import numpy as np
import pytest

from flax_mha.rotary import Rope
from helpers import randn
from test_rotary_scaling import B, H, K, T

pytestmark = pytest.mark.integration  # importing transformers takes ~10 s


@pytest.fixture(scope="module")
def hf():
  """transformers' rotary pieces of each family: name -> (config class, embedding class,
  apply_rotary_pos_emb)."""
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.models.cohere import modeling_cohere
  from transformers.models.glm import modeling_glm
  from transformers.models.gpt_neox import modeling_gpt_neox
  from transformers.models.gptj import modeling_gptj
  from transformers.models.llama import modeling_llama
  return {
      "llama": (transformers.LlamaConfig, modeling_llama.LlamaRotaryEmbedding,
                modeling_llama.apply_rotary_pos_emb),
      "gpt_neox": (transformers.GPTNeoXConfig, modeling_gpt_neox.GPTNeoXRotaryEmbedding,
                   modeling_gpt_neox.apply_rotary_pos_emb),
      "glm": (transformers.GlmConfig, modeling_glm.GlmRotaryEmbedding,
              modeling_glm.apply_rotary_pos_emb),
      "cohere": (transformers.CohereConfig, modeling_cohere.CohereRotaryEmbedding,
                 modeling_cohere.apply_rotary_pos_emb),
      "gptj": modeling_gptj,
  }


HF_CASES = [
    # (family, rope_parameters, the interleaving the family's code uses)
    ("llama", {"rope_type": "default", "rope_theta": 500.0}, False),
    ("llama", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, False),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512,
               "rope_theta": 10000.0}, False),
    ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
               "rope_theta": 10000.0}, False),
    ("llama", {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 512,
               "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
               "truncate": False, "rope_theta": 10000.0}, False),
    ("gpt_neox", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
     False),
    ("gpt_neox", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                  "rope_theta": 2000.0, "partial_rotary_factor": 0.5}, False),
    ("glm", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, True),
    ("glm", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
             "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, True),
    ("cohere", {"rope_type": "default", "rope_theta": 10000.0}, True),
]


@pytest.mark.parametrize("family,params,interleaved", HF_CASES,
                         ids=[f"{c[0]}-{c[1]['rope_type']}-{i}" for i, c in enumerate(HF_CASES)])
def test_matches_transformers(hf, rng, family, params, interleaved):
  import torch
  config_cls, embedding_cls, apply_pos_emb = hf[family]
  config = config_cls(hidden_size=H * K, num_attention_heads=H, num_key_value_heads=H,
                      head_dim=K, max_position_embeddings=2048, rope_parameters=dict(params))
  # Our loader path: the config as it would sit in config.json.
  rope = Rope.from_hf(config.to_dict(), K, interleaved=interleaved)
  embedding = embedding_cls(config)
  freq, scale = rope.frequencies(K)
  np.testing.assert_allclose(freq, embedding.inv_freq.numpy(), rtol=1e-6)
  assert scale == pytest.approx(embedding.attention_scaling, rel=1e-12)

  q, k = randn(rng, B, T, H, K), randn(rng, B, T, H, K)
  positions = rng.permutation(60)[:B * T].reshape(B, T)
  q_BHTK, k_BHTK = (torch.from_numpy(a.transpose(0, 2, 1, 3)) for a in (q, k))
  cos, sin = embedding(q_BHTK, torch.from_numpy(positions))
  want_q, want_k = apply_pos_emb(q_BHTK, k_BHTK, cos, sin)
  for x, want in ((q, want_q), (k, want_k)):
    np.testing.assert_allclose(rope.apply(x, positions), want.numpy().transpose(0, 2, 1, 3),
                               atol=1e-5)


def test_matches_transformers_gptj(hf, rng):
  """GPT-J: interleaved pairs over the first rotary_dim features, its own sin/cos table."""
  import torch
  gptj, rotary_dim = hf["gptj"], 6
  rope = Rope.from_hf({"rotary_dim": rotary_dim, "n_embd": H * K}, K, interleaved=True)
  x = randn(rng, B, T, H, K)
  positions = rng.permutation(60)[:B * T].reshape(B, T)
  table = gptj.create_sinusoidal_positions(64, rotary_dim)[torch.from_numpy(positions)]
  sin, cos = torch.split(table, rotary_dim // 2, dim=-1)
  x_BTHK = torch.from_numpy(x)
  rotated = gptj.apply_rotary_pos_emb(x_BTHK[..., :rotary_dim], sin, cos)
  want = torch.cat([rotated, x_BTHK[..., rotary_dim:]], dim=-1).numpy()
  np.testing.assert_allclose(rope.apply(x, positions), want, atol=1e-5)


def test_longrope_matches_transformers_below_and_past_the_original_context(hf, rng):
  """Phi-3's LongRoPE through the loader's path: the short factors while every position is
  within the original context (32), the long ones past it (transformers picks by the batch's
  largest position, flax_mha by each row's: here the rows are on one side)."""
  import torch
  import transformers
  from transformers.models.phi3 import modeling_phi3
  params = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(K // 2)],
            "long_factor": [2.0 + 1.5 * i for i in range(K // 2)]}
  config = transformers.Phi3Config(hidden_size=H * K, num_attention_heads=H, num_key_value_heads=H,
                                   max_position_embeddings=256,
                                   original_max_position_embeddings=32, rope_parameters=params)
  rope = Rope.from_hf(config.to_dict(), K)
  embedding = modeling_phi3.Phi3RotaryEmbedding(config)
  assert rope.frequencies(K)[1] == pytest.approx(embedding.attention_scaling, rel=1e-12)
  q, k = randn(rng, B, T, H, K), randn(rng, B, T, H, K)
  q_BHTK, k_BHTK = (torch.from_numpy(a.transpose(0, 2, 1, 3)) for a in (q, k))
  for positions in (rng.permutation(30)[:B * T].reshape(B, T),
                    30 + rng.permutation(60)[:B * T].reshape(B, T)):
    cos, sin = embedding(q_BHTK, torch.from_numpy(positions))
    want_q, want_k = modeling_phi3.apply_rotary_pos_emb(q_BHTK, k_BHTK, cos, sin)
    for x, want in ((q, want_q), (k, want_k)):
      np.testing.assert_allclose(rope.apply(x, positions), want.numpy().transpose(0, 2, 1, 3),
                                 atol=1e-5)
