"""Decoder-only LM on the dates task: rotary positions, GQA, local/global layers, packed documents.

  python -m experiments.train --config configs/lm.py --workdir runs/lm
  python -m experiments.train --config configs/lm.py:tiny --workdir runs/lm_tiny

Each (date text, ISO date) pair is a document `source BOS target EOS`; documents are packed into
rows of `train.length` tokens with segment ids, so a token attends only within its document
(the chunked kernel skips the tiles between documents). Exact match: the greedy answer after
`source BOS` for 1000 held-out dates.
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None):
  if arg not in (None, "tiny"):
    raise ValueError(f"config arg must be 'tiny' or absent, got {arg!r}")
  config = common.base_config("dates", heldout_percent=10)
  config.kind = "lm"  # experiments.train trains flax_mha.models.lm.DecoderLM
  config.model = ml_collections.ConfigDict(dict(
      d_model=128,  # residual width D
      num_heads=4,  # query heads H
      num_kv_heads=2,  # key/value heads G (GQA)
      num_layers=4,  # blocks: local, global, local, global
      d_ff=512,  # MLP width F
      local_window=16,  # keys a local layer sees before each query
      global_every=2,  # every 2nd block attends to its whole document
      rotary_max_wavelength=10_000.0,  # RoPE base
      logit_soft_cap=50.0,  # Gemma 2's attention soft cap
      normalize_qk=False,  # LayerNorm on queries and keys
      dropout_rate=0.0,  # on block outputs
  ))
  config.train.length = 128  # tokens per packed row (2-3 documents)
  config.train.batch_size = 32  # rows per step
  config.train.steps = 1000
  config.train.peak_lr = 2e-3
  config.train.label_smoothing = 0.0
  if arg == "tiny":
    config.model.update(d_model=32, num_heads=2, num_kv_heads=1, num_layers=2, d_ff=64)
    config.train.update(steps=20, batch_size=4, length=128, warmup_steps=5, log_every=5,
                        checkpoint_every=10)
    config.eval.update(every=10, num_examples=32, batch_size=16)
  return config
