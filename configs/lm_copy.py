"""A Llama-shaped decoder-only LM on the copy task: the target and draft models of the
speculative decoding benchmark (experiments/bench/speculative.py), where drafts can be right.

  python -m experiments.train --config configs/lm_copy.py --workdir runs/lm_copy
  python -m experiments.train --config configs/lm_copy.py:draft --workdir runs/lm_copy_draft
  (arg: absent for the target, "draft" for the smaller draft model, and/or "tiny")

Each document is `string BOS string EOS`, a random lowercase string of 1 to 48 letters twice
(experiments.lm_data). The draft: 2 layers of D=64 (78k parameters against
the target's 795k). The architecture is one that Hugging Face's Llama describes (RMSNorm,
SwiGLU, rotary positions, all layers global, no soft caps, untied output), so the benchmark can
export the trained weights as a transformers checkpoint and compare its `generate`.
"""

import ml_collections

from configs import common

MAX_LEN = 48  # letters of the longest string


def get_config(arg: str | None = None):
  words = (arg or "").split(",")
  if set(words) - {"", "draft", "tiny"}:
    raise ValueError(f"config arg must be 'draft', 'tiny', 'draft,tiny' or absent, got {arg!r}")
  config = common.base_config("copy", heldout_percent=10, min_len=1, max_len=MAX_LEN)
  config.kind = "lm"  # experiments.train trains flax_mha.models.lm.DecoderLM
  config.model = ml_collections.ConfigDict(dict(
      d_model=128,  # residual width D
      num_heads=4,  # query heads H
      num_kv_heads=2,  # key/value heads G (GQA)
      num_layers=4,  # blocks, all global
      d_ff=384,  # SwiGLU width F
      local_window=None,  # no local layers (Llama)
      logit_soft_cap=None,  # no attention soft cap (Llama)
      norm="rms",  # RMSNorm without bias (experiments.lm.model_config makes the Norm)
      mlp="swiglu",  # silu(x·gate) * (x·in), then ·out
      mlp_bias=False,
      tie_embeddings=False,  # a separate output projection, lm_head
      scale_embeddings=False,
      scale_logits=False,
  ))
  config.train.length = 128  # tokens per packed row (1 to 6 documents)
  config.train.batch_size = 16  # rows per step
  config.train.steps = 400
  config.train.peak_lr = 3e-3
  config.train.warmup_steps = 50
  config.train.schedule = "cosine"
  config.train.label_smoothing = 0.0
  config.train.log_every = 50
  config.train.checkpoint_every = 400
  config.eval.update(every=400, num_examples=64, batch_size=64)
  if "draft" in words:  # a tenth of the parameters; D=32 did not learn the copy in 400 steps
    config.model.update(d_model=64, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=128)
    config.train.update(steps=800, checkpoint_every=800)
    config.eval.update(every=800)
  if "tiny" in words:
    config.model.update(d_model=32, num_heads=2, num_kv_heads=1, num_layers=2, d_ff=64)
    config.train.update(steps=20, batch_size=4, warmup_steps=5, log_every=5,
                        checkpoint_every=10)
    config.eval.update(every=10, num_examples=16, batch_size=16)
  return config
