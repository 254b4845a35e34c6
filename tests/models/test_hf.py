"""`flax_mha.models.hf` without transformers: the family presets read from config dicts, the
tensor table's transforms on a hand-written Llama checkpoint (safetensors written with NumPy),
and every refusal by name: an unknown model_type, an unsupported rope scaling or activation, a
missing tensor, a tensor of the wrong shape, an unexpected extra one, a file cut short or not
JSON (named, with its shard), a missing config key, a dtype the decoder does not compute in.
Against transformers' own models: tests/models/test_hf_integration.py.

Dimension key: D d_model, H heads, G kv heads, K head dim, F MLP width, C vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_checkpoints as hc
from flax_mha.models import hf, hf_config, hf_tables
from flax_mha.models.lm_config import MLA, MoE
from flax_mha.nn.options import Norm
from flax_mha.rotary import Llama3Scaling, LinearScaling, LongRopeScaling

pytest.importorskip("safetensors")

C, D, H, G, K, F, LAYERS = 37, 24, 4, 2, 6, 40, 2
LLAMA = dict(model_type="llama", vocab_size=C, hidden_size=D, num_attention_heads=H,
             num_key_value_heads=G, num_hidden_layers=LAYERS, intermediate_size=F,
             rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})


def _llama_tensors(rng) -> dict:
  """Every tensor of the LLAMA config, in torch's layouts, random."""
  return hc.llama_tensors({**LLAMA, "head_dim": K}, rng)


@pytest.fixture
def llama(tmp_path, rng):
  """(directory, tensors) of a hand-written Llama checkpoint with head_dim K != D / H."""
  tensors = _llama_tensors(rng)
  return hc.write_checkpoint(tmp_path / "llama", {**LLAMA, "head_dim": K}, tensors), tensors


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
  _, variables = hf.load(directory, dtype="float16")  # as docs/hf.md and --dtype say
  assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {np.dtype(np.float16)}


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
  directory = hc.write_checkpoint(tmp_path / "bad", {**LLAMA, "head_dim": K}, tensors)
  with pytest.raises(ValueError, match=match):
    hf.load(directory)


def test_a_tied_config_refuses_a_saved_lm_head(tmp_path, rng):
  directory = hc.write_checkpoint(tmp_path / "tied", {**LLAMA, "head_dim": K, "tie_word_embeddings": True},
                     _llama_tensors(rng))
  with pytest.raises(ValueError, match=r"'lm_head.weight' fills parameter 'lm_head/kernel', "
                                       r"which its config does not have"):
    hf.load(directory)


@pytest.mark.parametrize("change, match", [
    (dict(model_type="falcon"), r"model_type 'falcon' is not supported: supported are \["),
    (dict(model_type="gemma3"), r"model_type 'gemma3' is not supported.*gemma3_text"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     r"rope scaling type 'dynamic' is not supported"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
     r"rope scaling 'longrope' needs \['short_factor', 'long_factor', "),
    (dict(hidden_act="relu"), r"hidden_act 'relu' is not supported"),
    (dict(mlp_bias=True), r"mlp_bias=True is not supported"),
    (dict(dtype="float8_e4m3fn"), r"checkpoint dtype 'float8_e4m3fn' is not supported"),
    (dict(layer_types=["sliding_attention", "full_attention"]),
     r"layer_types has sliding layers but sliding_window is None"),
    (dict(model_type="phi3", rope_parameters=None, rope_scaling={"type": "su"}),
     r"rope scaling 'longrope' needs \['short_factor', 'long_factor', "),
    (dict(model_type="phi3", rope_parameters={"rope_type": "linear", "factor": 2.0}),
     r"rope scaling type 'linear' is not supported for phi3"),
    (dict(model_type="gpt_oss", quantization_config={"quant_method": "mxfp4"}),
     r"quantization_config=\{'quant_method': 'mxfp4'\} is not supported"),
])
def test_an_unsupported_config_is_refused_by_name(change, match):
  with pytest.raises(ValueError, match=match):
    hf_config.config_from_hf({**LLAMA, **change})


def test_glm4_moe_reads_deepseek_v3s_router_and_its_dense_first_layers():
  config = hf_config.config_from_hf({
      **LLAMA, "model_type": "glm4_moe", "num_hidden_layers": 3, "n_routed_experts": 8,
      "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 5,
      "n_shared_experts": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
      "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True})
  assert config.moe == MoE(8, 3, 5, normalize=True, layers=(1, 2), router="sigmoid_groups",
                           groups=(4, 2), routed_scale=2.5, shared_d_ff=10, float32_router=True)
  assert config.qkv_bias and not config.out_bias and config.normalize_qk.kind == "rms"


DEEPSEEK = {**LLAMA, "model_type": "deepseek_v3", "num_hidden_layers": 3,
            "num_key_value_heads": LLAMA["num_attention_heads"], "kv_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10, "q_lora_rank": 24,
            "n_routed_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 5,
            "n_shared_experts": 2, "first_k_dense_replace": 1, "n_group": 3, "topk_group": 2,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                "original_max_position_embeddings": 4096, "mscale": 1.0,
                                "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}


def test_deepseek_reads_latent_attention_yarns_scale_and_each_router():
  """V3: MLA, interleaved YaRN over the 8 rotary features, the softmax scale times
  (0.1·ln 40 + 1)², the sigmoid router; V2 (group_limited_greedy) the softmax one, never
  renormalised; V2-Lite's plain top-k and one query projection; rope_interleave false."""
  v3 = hf_config.config_from_hf(DEEPSEEK)
  assert v3.mla == MLA(16, 8, 12, 10, q_rank=24) and v3.cache_dims == (1, 24, 16)
  assert v3.rope.interleaved and v3.rope.scaling.mscale_all_dim == 1.0
  assert v3.attention_scale == pytest.approx(20 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
  assert v3.moe == MoE(6, 2, 5, normalize=True, layers=(1, 2), router="sigmoid_groups",
                       groups=(3, 2), routed_scale=2.5, shared_d_ff=10, float32_router=True)
  v2 = hf_config.config_from_hf({**DEEPSEEK, "model_type": "deepseek_v2", "norm_topk_prob": False,
                                 "topk_method": "group_limited_greedy"})
  assert v2.moe == MoE(6, 2, 5, normalize=False, layers=(1, 2), groups=(3, 2),
                       routed_scale=2.5, shared_d_ff=10, float32_router=True)
  lite = hf_config.config_from_hf({**DEEPSEEK, "model_type": "deepseek_v2", "q_lora_rank": None,
                                   "topk_method": "greedy", "norm_topk_prob": False,
                                   "rope_parameters": None})
  assert lite.mla.q_rank is None and lite.moe.groups == (1, 1)
  assert lite.attention_scale == 20 ** -0.5
  assert not hf_config.config_from_hf({**DEEPSEEK, "rope_interleave": False}).rope.interleaved


def test_deepseek_v3s_multi_token_prediction_layers_are_skipped_and_v2s_refused():
  """A tensor of layer num_hidden_layers (V3's and GLM-4.5's multi-token prediction layer) is
  skipped on load; a V2 checkpoint has none, so one there is refused by the table."""
  name = "model.layers.3.self_attn.q_a_proj.weight"
  assert hf_tables.ignored("deepseek_v3", name, 3) and hf_tables.ignored("glm4_moe", name, 3)
  assert not hf_tables.ignored("deepseek_v3", name.replace("3", "2", 1), 3)
  assert not hf_tables.ignored("deepseek_v2", name, 3)


@pytest.mark.parametrize("change, match", [
    (dict(model_type="deepseek_v2", topk_method="noaux_tc"),
     r"topk_method='noaux_tc' is not supported \(supported: \['greedy', 'group_limited_greedy'"),
    (dict(model_type="deepseek_v2", topk_method="greedy", norm_topk_prob=True),
     r"norm_topk_prob=True is not supported"),
    (dict(scoring_func="softmax"), r"scoring_func='softmax' is not supported"),
    (dict(num_key_value_heads=2), r"num_key_value_heads=2 must equal num_attention_heads=4"),
    (dict(qk_rope_head_dim=7), r"apply_rotary needs an even head dim K, got K=7"),
])
def test_a_deepseek_config_the_decoder_cannot_take_is_refused_by_name(change, match):
  with pytest.raises(ValueError, match=match):
    hf_config.config_from_hf({**DEEPSEEK, **change})


@pytest.mark.parametrize("kind", ["longrope", "su", "yarn"])
def test_phi3_reads_longrope_and_its_old_spellings(kind):
  """transformers' Phi3Config reads a 4.x config's "su" and "yarn" as "longrope"."""
  config = hf_config.config_from_hf({
      **LLAMA, "model_type": "phi3", "rope_parameters": None, "max_position_embeddings": 64,
      "original_max_position_embeddings": 16,
      "rope_scaling": {"type": kind, "short_factor": [1.0, 1.5, 2.0], "long_factor": [2, 3, 4]}})
  assert config.rope.scaling == LongRopeScaling((1.0, 1.5, 2.0), (2.0, 3.0, 4.0), 16, factor=4.0)


def test_missing_files_are_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    hf.load(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(LLAMA))
  with pytest.raises(FileNotFoundError, match="no model.safetensors"):
    hf.load(tmp_path)


def _cut(path):
  """Keep the first half of the file `path`, as an interrupted download leaves it."""
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])


_UNREADABLE = {
    "a cut model.safetensors": (1, "model.safetensors", _cut, (
        r"model\.safetensors cannot be read as safetensors \(.*incomplete metadata.*\): "
        r"expected a complete safetensors file, found a truncated or corrupt one")),
    "a cut shard": (3, "model-00002-of-00003.safetensors", _cut,
                    r"^shard 2 of 3, .*model-00002-of-00003\.safetensors cannot be read"),
    "config.json not JSON": (
        1, "config.json", lambda p: p.write_text('{"model_type": "llama",\n "vocab_size": }'),
        r"config\.json is not valid JSON: Expecting value at line 2, column 16"),
    "config.json a list": (1, "config.json", lambda p: p.write_text("[1, 2]"),
                           r"config\.json holds a JSON list, expected an object"),
    "config.json without a key": (
        1, "config.json", lambda p: p.write_text(json.dumps(
            {k: v for k, v in LLAMA.items() if k != "num_attention_heads"})),
        r"config\.json: the config lacks the key 'num_attention_heads', which a llama config "
        r"needs"),
    "an index not JSON": (3, "model.safetensors.index.json", _cut,
                          r"model\.safetensors\.index\.json is not valid JSON: .* at line 1"),
    "an index without weight_map": (
        3, "model.safetensors.index.json", lambda p: p.write_text(json.dumps({"metadata": {}})),
        r"model\.safetensors\.index\.json: expected the key 'weight_map', a mapping of tensor "
        r"names to shard files, got None"),
}


@pytest.mark.parametrize("case", _UNREADABLE)
def test_an_unreadable_file_is_named(tmp_path, rng, case):
  """A CheckpointError (a ValueError) naming the file by its path, its shard where there are
  several, and what was expected of it."""
  shards, name, damage, match = _UNREADABLE[case]
  directory = hc.write_checkpoint(tmp_path / "llama", {**LLAMA, "head_dim": K},
                                  _llama_tensors(rng), shards=shards)
  hf.load(directory)  # whole, it loads
  damage(directory / name)
  with pytest.raises(ValueError, match=match) as error:
    hf.load(directory)
  assert isinstance(error.value, hf.CheckpointError) and str(directory / name) in str(error.value)


def test_a_missing_shard_is_named(tmp_path, rng):
  directory = hc.write_checkpoint(tmp_path / "llama", LLAMA, _llama_tensors(rng), shards=3)
  (directory / "model-00003-of-00003.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match=r"^shard 3 of 3, .*model-00003-of-00003"
                                              r"\.safetensors, named by .*index\.json, is missing"):
    hf.load(directory)


def test_a_missing_config_key_is_a_value_error_and_a_key_error():
  """config_from_hf alone (no file to name): the key and the family."""
  for config, key, fam in ((LLAMA, "vocab_size", "llama"),
                           (dict(model_type="gpt2", vocab_size=C, n_head=H, n_layer=1,
                                 n_positions=8, activation_function="gelu_new"), "n_embd",
                            "gpt2")):
    config = {k: v for k, v in config.items() if k != key}
    with pytest.raises(ValueError) as error:
      hf_config.config_from_hf(config)
    assert str(error.value) == f"the config lacks the key {key!r}, which a {fam} config needs"
    assert isinstance(error.value, hf_config.MissingKey) and isinstance(error.value, KeyError)


def test_the_tokenizer_and_generation_config_are_named_when_unreadable(tmp_path):
  pytest.importorskip("tokenizers")
  (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
  with pytest.raises(ValueError, match=r"tokenizer\.json cannot be read as a tokenizer "
                                      r"\(.*\): expected the tokenizer\.json"):
    hf.load_tokenizer(tmp_path)
  generation = tmp_path / "generation_config.json"
  generation.write_text("{'eos_token_id': 2}")  # Python's repr, not JSON
  with pytest.raises(ValueError, match=r"generation_config\.json is not valid JSON: "
                                      r"Expecting property name .* line 1, column 2"):
    hf.stop_tokens(tmp_path)
  generation.write_text(json.dumps({"eos_token_id": "</s>"}))
  with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id must be an int "
                                      r"or a list of ints, got '</s>'"):
    hf.stop_tokens(tmp_path)
  generation.write_text(json.dumps({"eos_token_id": [2, 7]}))
  assert hf.stop_tokens(tmp_path) == (2, 7)


@pytest.mark.parametrize("dtype", [np.int32, "int8", bool, jnp.complex64, jnp.float8_e4m3fn,
                                   "no such type"])
def test_a_dtype_the_decoder_does_not_compute_in_is_refused_by_name(llama, dtype):
  directory, _ = llama
  with pytest.raises(TypeError, match=r"^dtype must be one of \['float32', 'bfloat16', "
                                      r"'float16', 'float64'\] \(float64 with jax_enable_x64\), "
                                      r"got "):
    hf.load(directory, dtype=dtype)


def check_float64_loads_only_under_x64(llama):
  """Refused by name without jax_enable_x64 (jax would compute float32); with it, float64
  parameters and computation (the logits are float32 in every dtype: `lm.output_logits`),
  equal to the float32 model's to float32's precision."""
  directory, _ = llama
  assert not jax.config.jax_enable_x64
  for dtype in (np.float64, "float64", jnp.float64):
    with pytest.raises(TypeError, match=r"^dtype .* \(float64\) needs jax_enable_x64, which is "
                                        r"off: jax would compute in float32"):
      hf.load(directory, dtype=dtype)
  tokens = np.arange(5)[None]
  model32, variables32 = hf.load(directory, dtype="float32")
  want = np.asarray(model32.apply(variables32, tokens))
  with jax.enable_x64(True):
    model, variables = hf.load(directory, dtype="float64")
    assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {np.dtype(np.float64)}
    assert model.config.dtype == model.config.param_dtype == np.float64
    logits = model.apply(variables, jnp.asarray(tokens))
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)


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


def test_phi3s_fused_tensors_split_into_llamas_parameters(tmp_path, rng):
  """A Phi-3 checkpoint whose qkv_proj and gate_up_proj fuse a Llama checkpoint's tensors
  (rows q, k, v; gate, up) loads to the very parameters of that Llama checkpoint."""
  tensors = _llama_tensors(rng)
  fused = dict(tensors)
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    fused[p + "self_attn.qkv_proj.weight"] = np.concatenate(
        [fused.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
    fused[p + "mlp.gate_up_proj.weight"] = np.concatenate(
        [fused.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
  config = {**LLAMA, "head_dim": K}
  llama = hc.write_checkpoint(tmp_path / "llama", config, tensors)
  phi3 = hc.write_checkpoint(tmp_path / "phi3", {**config, "model_type": "phi3"}, fused)
  jax.tree.map(np.testing.assert_array_equal, hf.load(phi3)[1], hf.load(llama)[1])


def test_olmo2_and_phi3_presets():
  """OLMo 2 normalises the sublayers' outputs only, its qk-norm across all heads (a model norm
  cannot be: refused by name); Phi-3's sliding window makes every layer local, its
  partial_rotary_factor rotates a share of K."""
  olmo2 = hf_config.config_from_hf({**LLAMA, "model_type": "olmo2"})
  assert not olmo2.pre_norms and olmo2.post_norms and olmo2.local_window is None
  assert olmo2.normalize_qk == Norm("rms", 1e-5, use_bias=False, across_heads=True)
  with pytest.raises(ValueError, match="LMConfig.norm normalises the residual: across_heads"):
    dataclasses.replace(olmo2, norm=olmo2.normalize_qk)
  phi3 = hf_config.config_from_hf({**LLAMA, "model_type": "phi3", "sliding_window": 8,
                                   "head_dim": 8,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.5}})
  assert phi3.layer_types == ("local", "local") and phi3.local_window == 7
  assert phi3.rope.fraction == 0.5 and phi3.pre_norms and not phi3.post_norms


MIXTRAL = {**LLAMA, "model_type": "mixtral", "head_dim": K, "num_local_experts": 3,
           "num_experts_per_tok": 2}


def _mixtral_tensors(rng) -> dict:
  """LLAMA's tensors with each layer's MLP replaced by a router and 3 experts (w1 gate, w3 up,
  w2 down), as Mixtral's checkpoints name them."""
  tensors = {n: t for n, t in _llama_tensors(rng).items() if ".mlp." not in n}
  for i in range(LAYERS):
    p = f"model.layers.{i}.block_sparse_moe."
    tensors[p + "gate.weight"] = rng.standard_normal((3, D)).astype(np.float32)
    for e in range(3):
      for w, shape in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F))):
        tensors[p + f"experts.{e}.{w}.weight"] = rng.standard_normal(shape).astype(np.float32)
  return tensors


def test_each_experts_tensors_fill_its_row_of_a_stacked_parameter(tmp_path, rng):
  tensors = _mixtral_tensors(rng)
  directory = hc.write_checkpoint(tmp_path / "mixtral", MIXTRAL, tensors)
  model, variables = hf.load(directory)
  experts = variables["params"]["block_1"]["moe"]
  p = "model.layers.1.block_sparse_moe."
  np.testing.assert_array_equal(experts["router"]["kernel"], tensors[p + "gate.weight"].T)
  for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
    np.testing.assert_array_equal(experts[ours], np.stack(
        [tensors[p + f"experts.{e}.{theirs}.weight"].T for e in range(3)]))
  logits = model.apply(variables, jnp.arange(5)[None])
  np.testing.assert_allclose(hf.load_nnx(directory)(jnp.arange(5)[None]), logits, atol=1e-5)


@pytest.mark.parametrize("change, match", [
    (lambda t: t.pop("model.layers.0.block_sparse_moe.experts.2.w3.weight"),
     r"lacks tensors for 1 parameters .*'block_0/moe/up'.* \(each filled by "
     r"'model.layers.0.block_sparse_moe.experts.\{e\}.w3.weight'\); experts missing: "
     r"\{'block_0/moe/up': \[2\]\}"),
    (lambda t: t.update({"model.layers.0.block_sparse_moe.experts.3.w1.weight":
                         np.ones((F, D), np.float32)}),
     r"tensor 'model.layers.0.block_sparse_moe.experts.3.w1.weight' gives expert 3 of parameter "
     r"'block_0/moe/gate' shape \(24, 40\), its config wants 3 experts of \(24, 40\)"),
    (lambda t: t.update({"model.layers.0.mlp.gate_proj.weight": np.ones((F, D), np.float32)}),
     r"'model.layers.0.mlp.gate_proj.weight' fills parameter 'block_0/mlp_gate/kernel', which "
     r"its config does not have"),
])
def test_experts_that_do_not_fit_the_config_are_refused_by_name(tmp_path, rng, change, match):
  tensors = _mixtral_tensors(rng)
  change(tensors)
  with pytest.raises(ValueError, match=match):
    hf.load(hc.write_checkpoint(tmp_path / "bad", MIXTRAL, tensors))


def test_the_moe_presets_read_each_variant():
  """Mixtral: every layer sparse, renormalised, experts intermediate_size wide, jitter refused;
  Qwen3-MoE: num_experts (or transformers 5's num_local_experts), decoder_sparse_step and
  mlp_only_layers, norm_topk_prob (default off), no experts at all when num_experts is 0;
  gpt-oss: biases, the clamped unit, learned sinks, its layer types and YaRN."""
  mixtral = hf_config.config_from_hf(MIXTRAL)
  assert mixtral.moe == MoE(3, 2, F, normalize=True) and mixtral.is_sparse(1)
  with pytest.raises(ValueError, match=r"router_jitter_noise=0.1 is not supported"):
    hf_config.config_from_hf({**MIXTRAL, "router_jitter_noise": 0.1})
  qwen = {**LLAMA, "model_type": "qwen3_moe", "num_hidden_layers": 6, "num_experts": 8,
          "num_experts_per_tok": 2, "moe_intermediate_size": 12}
  every = hf_config.config_from_hf(qwen)
  assert every.moe == MoE(8, 2, 12, normalize=False, layers=tuple(range(6)))
  assert every.normalize_qk == Norm("rms", 1e-5, use_bias=False) and every.d_ff == F
  some = hf_config.config_from_hf({**qwen, "decoder_sparse_step": 2, "mlp_only_layers": [3],
                                   "norm_topk_prob": True, "num_experts": None,
                                   "num_local_experts": 8})
  assert some.moe == MoE(8, 2, 12, normalize=True, layers=(1, 5))
  assert [some.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
  assert hf_config.config_from_hf({**qwen, "num_experts": 0}).moe is None
  oss = hf_config.config_from_hf({
      **LLAMA, "model_type": "gpt_oss", "head_dim": 16, "num_local_experts": 4,
      "num_experts_per_tok": 2, "sliding_window": 8, "attention_bias": True,
      "swiglu_limit": 1.5, "layer_types": ["sliding_attention", "full_attention"],
      "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 32.0,
                          "original_max_position_embeddings": 64, "truncate": False}})
  assert oss.moe == MoE(4, 2, F, normalize=True, bias=True, clamped_glu=(1.702, 1.5))
  assert oss.learned_sinks and oss.qkv_bias and oss.out_bias and oss.layer_types == (
      "local", "global")
  assert not oss.rope.scaling.truncate and oss.local_window == 7
