"""`flax_mha.models.hf` without transformers: the family presets read from config dicts, the
tensor table's transforms on a hand-written Llama checkpoint (safetensors written with NumPy),
and every refusal by name: an unknown model_type, an unsupported rope scaling or activation, a
missing tensor, a tensor of the wrong shape, an unexpected extra one. Against transformers'
own models: tests/models/test_hf_integration.py.

Dimension key: D d_model, H heads, G kv heads, K head dim, F MLP width, C vocabulary.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha.models import hf, hf_config
from flax_mha.nn.options import Norm
from flax_mha.rotary import Llama3Scaling, LinearScaling

safetensors_numpy = pytest.importorskip("safetensors.numpy")

C, D, H, G, K, F, LAYERS = 37, 24, 4, 2, 6, 40, 2
LLAMA = dict(model_type="llama", vocab_size=C, hidden_size=D, num_attention_heads=H,
             num_key_value_heads=G, num_hidden_layers=LAYERS, intermediate_size=F,
             rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})


def _llama_tensors(rng) -> dict:
  """Every tensor of the LLAMA config, in torch's layouts, random."""
  t = {"model.embed_tokens.weight": (C, D), "model.norm.weight": (D,), "lm_head.weight": (C, D)}
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    t.update({p + "self_attn.q_proj.weight": (H * K, D), p + "self_attn.k_proj.weight": (G * K, D),
              p + "self_attn.v_proj.weight": (G * K, D), p + "self_attn.o_proj.weight": (D, H * K),
              p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
              p + "mlp.down_proj.weight": (D, F), p + "input_layernorm.weight": (D,),
              p + "post_attention_layernorm.weight": (D,)})
  return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in t.items()}


def _write(directory, config: dict, tensors: dict):
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.json").write_text(json.dumps(config))
  safetensors_numpy.save_file(tensors, str(directory / "model.safetensors"))
  return directory


@pytest.fixture
def llama(tmp_path, rng):
  """(directory, tensors) of a hand-written Llama checkpoint with head_dim K != D / H."""
  tensors = _llama_tensors(rng)
  return _write(tmp_path / "llama", {**LLAMA, "head_dim": K}, tensors), tensors


def test_the_table_maps_torch_layouts_to_ours(llama):
  directory, tensors = llama
  model, variables = hf.load(directory)
  params = variables["params"]
  attn = params["block_1"]["attention"]
  q = tensors["model.layers.1.self_attn.q_proj.weight"]  # [H·K, D]
  np.testing.assert_array_equal(attn["query"]["kernel"], q.T.reshape(D, H, K))
  k = tensors["model.layers.1.self_attn.k_proj.weight"]
  np.testing.assert_array_equal(attn["key"]["kernel"], k.T.reshape(D, G, K))
  o = tensors["model.layers.1.self_attn.o_proj.weight"]  # [D, H·K]
  np.testing.assert_array_equal(attn["out"]["kernel"], o.T.reshape(H, K, D))
  np.testing.assert_array_equal(params["block_0"]["mlp_gate"]["kernel"],
                                tensors["model.layers.0.mlp.gate_proj.weight"].T)
  np.testing.assert_array_equal(params["lm_head"]["kernel"], tensors["lm_head.weight"].T)
  np.testing.assert_array_equal(params["block_0"]["mlp_norm"]["scale"],
                                tensors["model.layers.0.post_attention_layernorm.weight"])
  assert model.config.head_dim == K and model.config.norm == Norm("rms", 1e-5, use_bias=False)
  logits = model.apply(variables, jnp.arange(5)[None])
  assert logits.shape == (1, 5, C) and np.isfinite(logits).all()
  module = hf.load_nnx(directory)
  np.testing.assert_allclose(module(jnp.arange(5)[None]), logits, atol=1e-5)


def test_the_dtype_is_the_checkpoints_or_the_one_asked(llama):
  directory, _ = llama
  config = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
  _, variables = hf.load(directory)
  assert variables["params"]["embed"]["embedding"].dtype == jnp.bfloat16
  _, variables = hf.load(directory, dtype=jnp.float32)
  assert variables["params"]["embed"]["embedding"].dtype == jnp.float32


@pytest.mark.parametrize("change, match", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     r"lacks tensors for 1 parameters.*block_1/mlp_in/kernel.*'model.layers.1.mlp.up_proj.weight'"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((H * K + 1, D),
                                                                            np.float32)}),
     r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \(25, 24\), which does not "
     r"give the parameters \{'block_0/attention/query/kernel': \(24, 4, 6\)\}"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": np.zeros((F + 1, D),
                                                                       np.float32)}),
     r"tensor 'model.layers.0.mlp.up_proj.weight' gives parameter 'block_0/mlp_in/kernel' "
     r"shape \(24, 41\), its config wants \(24, 40\)"),
    (lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(3, np.float32)}),
     r"tensor 'model.layers.0.self_attn.rotary_emb.inv_freq' matches 0 rules"),
    (lambda t: t.update({"model.layers.2.input_layernorm.weight": np.ones(D, np.float32)}),
     r"'model.layers.2.input_layernorm.weight' fills parameter 'block_2/attention_norm/scale', "
     r"which its config does not have"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.ones(H * K, np.float32)}),
     r"fills parameter 'block_0/attention/query/bias', which its config does not have"),
])
def test_a_checkpoint_that_does_not_fit_its_config_is_refused_by_name(tmp_path, rng, change,
                                                                     match):
  tensors = _llama_tensors(rng)
  change(tensors)
  directory = _write(tmp_path / "bad", {**LLAMA, "head_dim": K}, tensors)
  with pytest.raises(ValueError, match=match):
    hf.load(directory)


def test_a_tied_config_refuses_a_saved_lm_head(tmp_path, rng):
  directory = _write(tmp_path / "tied", {**LLAMA, "head_dim": K, "tie_word_embeddings": True},
                     _llama_tensors(rng))
  with pytest.raises(ValueError, match=r"'lm_head.weight' fills parameter 'lm_head/kernel', "
                                       r"which its config does not have"):
    hf.load(directory)


@pytest.mark.parametrize("change, match", [
    (dict(model_type="phi3"), r"model_type 'phi3' is not supported: supported are \["),
    (dict(model_type="gemma3"), r"model_type 'gemma3' is not supported.*gemma3_text"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     r"rope scaling type 'dynamic' is not supported"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
     r"rope scaling type 'longrope' is not supported"),
    (dict(hidden_act="relu"), r"hidden_act 'relu' is not supported"),
    (dict(mlp_bias=True), r"mlp_bias=True is not supported"),
    (dict(dtype="float8_e4m3fn"), r"checkpoint dtype 'float8_e4m3fn' is not supported"),
    (dict(layer_types=["sliding_attention", "full_attention"]),
     r"layer_types has sliding layers but sliding_window is None"),
])
def test_an_unsupported_config_is_refused_by_name(change, match):
  with pytest.raises(ValueError, match=match):
    hf_config.config_from_hf({**LLAMA, **change})


def test_missing_files_are_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    hf.load(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(LLAMA))
  with pytest.raises(FileNotFoundError, match="no model.safetensors"):
    hf.load(tmp_path)


def test_the_presets_read_each_familys_conventions():
  """transformers' sliding_window W is our local_window W - 1; Mistral's window makes every
  layer local; Gemma 2's scale is query_pre_attn_scalar**-0.5 with its soft caps and
  post-norms; Gemma 3's local layers keep their own base while the global ones scale; Qwen2
  has q/k/v biases without an output bias; GPT-2 learns its positions."""
  mistral = hf_config.config_from_hf({**LLAMA, "model_type": "mistral", "sliding_window": 8})
  assert mistral.local_window == 7 and mistral.layer_types == ("local", "local")
  llama3 = hf_config.config_from_hf({**LLAMA, "rope_parameters": {
      "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
  assert isinstance(llama3.rope.scaling, Llama3Scaling) and llama3.local_window is None
  untied = {k: v for k, v in LLAMA.items() if k != "tie_word_embeddings"}  # Gemma's default
  gemma2 = hf_config.config_from_hf({
      **untied, "model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 24,
      "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 8,
      "hidden_activation": "gelu_pytorch_tanh", "layer_types": [
          "sliding_attention", "full_attention"]})
  assert gemma2.attention_scale == 24 ** -0.5 and gemma2.logit_soft_cap == 50.0
  assert gemma2.final_logit_soft_cap == 30.0 and gemma2.post_norms and gemma2.mlp == "geglu"
  assert gemma2.norm.kind == "rms_one_plus" and gemma2.scale_embeddings
  assert gemma2.is_local(0) and not gemma2.is_local(1) and gemma2.tie_embeddings
  gemma3 = hf_config.config_from_hf({
      **LLAMA, "model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 16,
      "sliding_window": 8, "hidden_activation": "gelu_pytorch_tanh",
      "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
          "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}})
  assert gemma3.local_rope.max_wavelength == 1e4 and gemma3.local_rope.scaling is None
  assert gemma3.rope.max_wavelength == 1e6 and gemma3.rope.scaling == LinearScaling(8.0)
  assert gemma3.normalize_qk == Norm("rms_one_plus", 1e-5, use_bias=False)
  qwen2 = hf_config.config_from_hf({**LLAMA, "model_type": "qwen2"})
  assert qwen2.qkv_bias and not qwen2.out_bias
  gemma = hf_config.config_from_hf({**LLAMA, "model_type": "gemma", "hidden_act": "gelu"})
  assert gemma.mlp == "geglu"  # Gemma's legacy spelling of the tanh approximation
  gpt2 = hf_config.config_from_hf(dict(model_type="gpt2", vocab_size=C, n_embd=D, n_head=H,
                                       n_layer=1, n_positions=32,
                                       activation_function="gelu_new"))
  assert gpt2.positions == "learned" and gpt2.max_positions == 32 and gpt2.norm.epsilon == 1e-5
  assert gpt2.qkv_bias and gpt2.out_bias and gpt2.d_ff == 4 * D and gpt2.attention_options(
      False).rotary is None
