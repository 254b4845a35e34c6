"""A NaN born in the activations of one packed document, through the decoder-only LM: by default
attention spreads it to every document of the row (a hidden key's 0 · NaN), with
`attention_implementation=flax_mha.confine_nonfinite()` the other documents' logits are those
of the row whose bad document is made good."""

from __future__ import annotations

import jax
import numpy as np

import flax_mha
from experiments import lm_data
from experiments.lm import LMRunner
from experiments.tasks import get_task
from flax_mha.models.lm import DecoderLM, LMConfig

TASK = get_task("reverse", heldout_percent=10, min_len=1, max_len=9)
# An id in range whose embedding row is finite but huge: LayerNorm's variance overflows to inf,
# and its activations are NaN from the first block on (the parameters stay finite, and the tied
# output projection gives its column finite logits everywhere).
POISON = TASK.vocab.encode("z")[0]


def _logits(implementation, *sources):
  """For each source: the logits [L, C] of one packed row of documents 'abc', the source and
  'de', the embedding row of POISON set to 1e30; and where the documents other than the
  source's lie."""
  model = DecoderLM(LMConfig(vocab_size=TASK.vocab.size, d_model=16, num_heads=2,
                             num_kv_heads=1, num_layers=2, d_ff=16, local_window=5,
                             attention_implementation=implementation))
  batches = [lm_data.pack([lm_data.document(TASK, s, s[::-1]) for s in ("abc", source, "de")],
                          batch_size=1, length=29) for source in sources]
  assert all(batch["segment_ids"].max() == 3 for batch in batches)  # all three in one row
  apply = jax.jit(model.apply)
  params = jax.jit(model.init)(jax.random.key(0), *LMRunner.inputs(batches[0]))["params"]
  params["embed"]["embedding"] = params["embed"]["embedding"].at[POISON].set(1e30)
  return [(np.asarray(apply({"params": params}, *LMRunner.inputs(batch))[0]),
           (batch["segment_ids"][0] != 2) & (batch["segment_ids"][0] > 0))
          for batch in batches]


def test_by_default_a_nan_of_one_document_reaches_the_others():
  """The default's documented behaviour (no cost paid to avoid it)."""
  [(logits, others)] = _logits(None, "xzy")
  assert np.isnan(logits[others]).all()


def test_confine_nonfinite_keeps_it_in_its_document():
  (logits, others), (good, same) = _logits(flax_mha.confine_nonfinite(), "xzy", "xwy")
  np.testing.assert_array_equal(others, same)
  assert np.isnan(logits[~others & (np.arange(len(others)) >= 8)]).any()  # its own document
  assert np.isfinite(logits[others]).all()
  np.testing.assert_allclose(logits[others], good[others], atol=1e-5, rtol=1e-5)
