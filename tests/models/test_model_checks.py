"""Token ids, runner accounting and argument checks of the models and the runner (issue 17).

An out-of-vocabulary id inside `jit` is a NaN embedding that spreads to other documents: the
models (called eagerly), the runner, the generate command and generation check ids on the host
and name the bad one. The LM's tokens/s counts real
tokens once; its MLP kernels have a sharding rule; a sequence mesh that does not divide the
packed rows is refused before anything runs; the NNX constructor checks the soft cap; the implementation error says how to ask for ring.
"""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_mha
from configs import dates as dates_config
from configs import lm as lm_config
from experiments import data, lm_data, train
from experiments.lm import LMRunner
from experiments.seq2seq import Seq2SeqRunner
from experiments.tasks import PAD, get_task
from flax_mha.parallel import sharding
from flax_mha.models.transformer import beam_search, greedy_decode
from flax_mha.models import lm as lm_model
from flax_mha.models import tokens as tokens_lib
from flax_mha.models import lm_nnx
from flax_mha.models.lm import DecoderLM, LMConfig
from flax_mha.models.transformer import Transformer, TransformerConfig

TASK = get_task("reverse", heldout_percent=10, min_len=1, max_len=9)


def _packed(length=32):
  docs = [lm_data.document(TASK, "abc", "cba"), lm_data.document(TASK, "de", "ed")]
  return lm_data.pack(docs, batch_size=1, length=length)


@pytest.mark.parametrize("bad", [TASK.vocab.size, -1])
def test_out_of_vocabulary_token_poisons_other_documents_inside_jit(bad):
  """Why the host check exists: documented behaviour of the model under jit, for an id past
  the end and a negative one alike."""
  model = DecoderLM(LMConfig(vocab_size=TASK.vocab.size, d_model=16, num_heads=2,
                             num_kv_heads=1, num_layers=1, d_ff=16))
  batch = _packed()
  params = model.init(jax.random.key(0), batch["tokens"], batch["segment_ids"],
                      batch["positions"])
  tokens = batch["tokens"].copy()
  tokens[0, 9] = bad  # in the second document
  logits = jax.jit(model.apply)(params, tokens, batch["segment_ids"], batch["positions"])
  assert bool(jnp.isnan(logits[0, 0]).all())  # the first document is poisoned too


def _transformer(vocab_size=11):
  cfg = TransformerConfig(vocab_size=vocab_size, d_model=16, num_heads=2, num_encoder_layers=1,
                          num_decoder_layers=1, d_ff=16, max_len=12)
  good = jnp.array([[3, 4, 5, 0]])
  return cfg, Transformer(cfg).init(jax.random.key(0), good, good)["params"]


@pytest.mark.parametrize("bad", [TASK.vocab.size, -1])
def test_an_eager_model_call_refuses_an_out_of_vocabulary_id_by_name(bad):
  """Concrete ids are checked by the models themselves (inside jit they cannot be)."""
  lm_cfg = LMConfig(vocab_size=TASK.vocab.size, d_model=16, num_heads=2, num_kv_heads=1,
                    num_layers=1, d_ff=16)
  tokens = _packed()["tokens"].copy()
  params = DecoderLM(lm_cfg).init(jax.random.key(0), tokens)
  tokens[0, 9] = bad
  message = (f"tokens holds token id {bad} at position (0, 9), outside the "
             f"vocabulary [0, {TASK.vocab.size})")
  with pytest.raises(ValueError, match=re.escape(message)):
    DecoderLM(lm_cfg).apply(params, tokens)
  with pytest.raises(ValueError, match=re.escape(message)):
    lm_nnx.DecoderLM(lm_cfg, rngs=nnx.Rngs(0))(tokens)
  cfg, params = _transformer()
  good, bad = jnp.array([[3, 4, 5, 0]]), jnp.array([[3, -1, 5, 0]])
  for src, tgt, name in ((bad, good, "src"), (good, bad, "tgt_in")):
    with pytest.raises(ValueError, match=re.escape(
        f"{name} holds token id -1 at position (0, 1), outside the vocabulary [0, 11)")):
      Transformer(cfg).apply({"params": params}, src, tgt)


VOCAB = 11
GOOD = np.array([[3, 4, 5, 6], [7, 8, 9, 3]])  # [B, L], ids in [3, VOCAB): no padding


@functools.cache  # one compile per model and front end, shared by the bad ids
def _jitted_logits(name):
  """tokens [B, L] -> logits [B, L, C], jitted, of one model and front end (for the Transformer:
  with the tokens as the source or as the target input, the other side GOOD)."""
  if name.startswith("transformer"):
    cfg, params = _transformer(VOCAB)
    run = jax.jit(Transformer(cfg).apply)
    if name == "transformer_src":
      return lambda tokens: run({"params": params}, tokens, GOOD)
    return lambda tokens: run({"params": params}, GOOD, tokens)
  cfg = LMConfig(vocab_size=VOCAB, d_model=16, num_heads=2, num_kv_heads=1, num_layers=1,
                 d_ff=16)
  params = DecoderLM(cfg).init(jax.random.key(0), GOOD)
  if name == "lm_linen":
    return functools.partial(jax.jit(DecoderLM(cfg).apply), params)
  graphdef, state = nnx.split(lm_nnx.load_linen_params(lm_nnx.DecoderLM(cfg, rngs=nnx.Rngs(0)),
                                                       params))
  return functools.partial(jax.jit(lambda state, t: nnx.merge(graphdef, state)(t)), state)


@pytest.mark.parametrize("bad", [-1, -VOCAB, VOCAB])
@pytest.mark.parametrize("name", ["lm_linen", "lm_nnx", "transformer_src", "transformer_tgt_in"])
def test_inside_jit_every_id_outside_the_vocabulary_gives_nan_logits(name, bad):
  """Inside `jit` ids are traced and cannot be refused: an id outside [0, C) embeds as NaN,
  negative ones as ids >= C (jnp.take alone wraps -1 to the last row: finite, wrong logits),
  in every model and front end. Its row's logits are NaN; the other row's are those of the
  batch of good ids."""
  logits = _jitted_logits(name)
  tokens = GOOD.copy()
  tokens[0, 0] = bad  # seen by every position of row 0 (causal or not)
  got, want = np.asarray(logits(tokens)), np.asarray(logits(GOOD))
  assert np.isfinite(want).all()
  assert np.isnan(got[0]).all()
  np.testing.assert_allclose(got[1], want[1], atol=1e-6, rtol=1e-6)


def test_the_embedding_keeps_rows_in_range_and_nans_the_others():
  """`flax_mha.models.tokens.embed` over flax's linen and NNX Embed: rows of ids in [0, C)
  are the table's (NumPy indexing), every other id's row all NaN."""
  vocab, width = 7, 5
  table = np.random.default_rng(0).normal(size=(vocab, width)).astype(np.float32)
  ids = np.array([[0, 4, vocab - 1, -1], [vocab, -vocab, 2, -vocab - 1]])
  linen_embed = nn.Embed(vocab, width).bind({"params": {"embedding": table}})
  nnx_embed = nnx.Embed(vocab, width, rngs=nnx.Rngs(0))
  nnx_embed.embedding.value = jnp.asarray(table)
  inside = (ids >= 0) & (ids < vocab)
  for embedding in (linen_embed, nnx_embed):
    got = np.asarray(tokens_lib.embed(embedding, jnp.asarray(ids), vocab))
    np.testing.assert_array_equal(got[inside], table[ids[inside]])
    assert np.isnan(got[~inside]).all()


def test_a_transformer_batch_of_padding_only_runs():
  """An all-padding src or tgt_in (a model initialised with zeros) makes a boolean padding mask
  that hides every key from every query: taken as it is (only a numeric all-zero mask reads as
  torch's convention and is refused), eagerly and under jit alike, every query fully masked."""
  cfg, params = _transformer()
  pad = jnp.zeros((2, 4), jnp.int32)
  for src, tgt in ((pad, GOOD), (GOOD, pad)):
    eager = Transformer(cfg).apply({"params": params}, src, tgt)
    jitted = jax.jit(Transformer(cfg).apply)({"params": params}, src, tgt)
    assert eager.shape == (2, 4, 11) and np.isfinite(eager).all()
    np.testing.assert_allclose(eager, jitted, atol=1e-5, rtol=1e-5)
  assert Transformer(cfg).init(jax.random.key(0), pad, pad)


@pytest.mark.parametrize("kind,past_end", [("seq2seq", True), ("seq2seq", False), ("lm", True)])
def test_runner_refuses_out_of_vocabulary_ids_naming_them(monkeypatch, kind, past_end):
  """The host check of each training batch, before its step (numpy, no device sync)."""
  config_module, data_module, name = {"seq2seq": (dates_config, data, "src"),
                                      "lm": (lm_config, lm_data, "tokens")}[kind]
  runner = train.make_runner(config_module.get_config("tiny"))
  bad = runner.task.vocab.size if past_end else -1
  real = data_module.train_batch

  def poisoned(*args, **kwargs):
    batch = real(*args, **kwargs)
    batch[name][1, 2] = bad
    return batch

  monkeypatch.setattr(data_module, "train_batch", poisoned)
  with pytest.raises(ValueError, match=re.escape(
      f"batch 3 {name} holds token id {bad} at position (1, 2), outside the vocabulary "
      f"[0, {runner.task.vocab.size})")):
    runner.train_batch(3)


@pytest.mark.parametrize("config_module", [dates_config, lm_config])
def test_the_generate_command_refuses_a_prompt_outside_the_vocabulary(config_module):
  """`python -m experiments.generate` builds its prompts with the runner's
  `generation_inputs`, through the task's encoder, which refuses a character it lacks by name
  (and decoding checks the ids it is given: test_generation_refuses_out_of_vocabulary_prompts)."""
  runner = train.make_runner(config_module.get_config("tiny"))
  with pytest.raises(ValueError, match=re.escape("character '\\x00' of 'ab\\x00' is not in the "
                                                 "vocabulary")):
    runner.generation_inputs("ab\x00")


def test_generation_refuses_out_of_vocabulary_prompts():
  cfg, params = _transformer()
  src = jnp.array([[3, 4, 11, 0]])
  for search in (greedy_decode, beam_search):
    with pytest.raises(ValueError, match=re.escape(
        "src holds token id 11 at position (0, 2), outside the vocabulary [0, 11)")):
      search(cfg, params, src, max_len=4)


def test_lm_tokens_per_second_counts_each_real_token_once():
  batch = _packed()
  assert LMRunner.num_tokens(batch) == int(np.sum(batch["tokens"] != PAD)) == 14
  seq2seq = {"src": np.array([[5, 6, 0]]), "tgt_in": np.array([[1, 7, 0]]),
             "tgt_out": np.array([[7, 2, 0]])}
  assert Seq2SeqRunner.num_tokens(seq2seq) == 4


def test_lm_mlp_kernels_have_a_sharding_rule():
  model = DecoderLM(LMConfig(vocab_size=11, d_model=16, num_heads=2, num_kv_heads=1,
                             num_layers=2, d_ff=16))
  x = jnp.zeros((1, 8), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), x, x, x))["params"]
  axes = {sharding.path_str(p): sharding.logical_axes(sharding.path_str(p), leaf.ndim,
                                                      lm_model.PARAM_AXES)
          for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  assert axes["block_0/mlp_in/kernel"] == ("embed", "mlp")
  assert axes["block_0/mlp_out/kernel"] == ("mlp", "embed")


def test_lm_rows_a_sequence_mesh_cannot_split_are_refused_before_anything_runs(tmp_path):
  """The LM trains on a sequence mesh (tests/multidevice/check_train.py) whose layout divides
  its packed rows: 128 tokens in 2 x 3 zigzag chunks do not split."""
  config = lm_config.get_config("tiny")
  config.mesh.seq = 3
  with pytest.raises(ValueError, match=r"train.length=128 must be multiples of 6 \(mesh.seq=3"):
    train.train_and_evaluate(config, str(tmp_path / "run"))


@pytest.mark.parametrize("cap,error", [(-1.0, ValueError), (0.0, ValueError), ("3", TypeError)])
def test_nnx_checks_the_soft_cap_at_construction(cap, error):
  with pytest.raises(error, match="logit_soft_cap must be"):
    flax_mha.nn.nnx.MultiHeadAttention(2, 8, logit_soft_cap=cap, rngs=nnx.Rngs(0))


def test_unknown_implementation_error_says_how_to_ask_for_other_strategies():
  x = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match=r"flax_mha.sequence_parallel_implementation"):
    flax_mha.dot_product_attention(x, x, x, implementation="ulysses")
