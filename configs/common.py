"""The experiment config every task config starts from; see configs/dates.py for the launch line."""

import ml_collections


def base_config(task: str, **task_kwargs) -> ml_collections.ConfigDict:
  """Defaults for `task` (a name in experiments.tasks.TASKS) built with `task_kwargs`."""
  config = ml_collections.ConfigDict()
  config.seed = 0  # parameters, dropout and data order all follow from it

  config.task = ml_collections.ConfigDict()
  config.task.name = task  # experiments.tasks.TASKS key
  config.task.kwargs = ml_collections.ConfigDict(task_kwargs)  # the task factory's arguments

  config.model = ml_collections.ConfigDict()
  config.model.d_model = 128  # residual width D
  config.model.num_heads = 4  # attention heads H
  config.model.num_encoder_layers = 2  # encoder blocks
  config.model.num_decoder_layers = 2  # decoder blocks
  config.model.d_ff = 512  # FFN width F
  config.model.dropout_rate = 0.1  # on embeddings and every sublayer output (residual dropout)
  config.model.attention_dropout_rate = 0.0  # on attention weights (the paper uses none)

  config.train = ml_collections.ConfigDict()
  config.train.steps = 1200  # optimizer steps
  config.train.batch_size = 128  # examples per step
  config.train.peak_lr = 1e-3  # learning rate at the end of warm-up, then train.schedule
  config.train.warmup_steps = 200  # linear warm-up steps
  config.train.schedule = "rsqrt"  # after warm-up: "rsqrt" (the paper's) or "cosine" (to 0)
  config.train.weight_decay = 0.0  # adamw decoupled weight decay
  config.train.label_smoothing = 0.1  # mass spread over the non-target tokens
  config.train.grad_clip_norm = 1.0  # global-norm gradient clipping
  config.train.bucket_window = 16  # steps whose examples are sorted by length together
  config.train.length_buckets = (12, 16, 24, 40, 64, 96, 128)  # padded lengths: few shapes
  config.train.log_every = 50  # steps between training-metric rows
  config.train.checkpoint_every = 250  # steps between checkpoints (and at the end)
  config.train.remat = "none"  # recompute in the backward: "none", "layer" or "attention"

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = 1  # devices the batch is split over (must divide the batch sizes)
  config.mesh.fsdp = 1  # devices parameters, optimizer state and the batch are split over
  config.mesh.model = 1  # devices heads and FFN width are split over (Megatron-style)
  config.mesh.seq = 1  # devices the sequence is split over in training attention
  config.mesh.seq_strategy = "auto"  # ring, all_gather, ulysses or auto (docs/scale_out.md)
  config.mesh.seq_layout = "zigzag"  # contiguous, zigzag or striped: zigzag balances causal work

  config.eval = ml_collections.ConfigDict()
  config.eval.every = 500  # steps between evaluations (and at the end)
  config.eval.num_examples = 1000  # held-out examples (underlying values unseen in training)
  config.eval.batch_size = 500  # examples per evaluation batch
  return config


def parse_arg(arg: str | None, default: str) -> tuple[str, bool]:
  """'name', 'name,tiny', 'tiny' or None -> (name or `default`, whether tiny)."""
  words = (arg or "").split(",")
  names = [w for w in words if w and w != "tiny"]
  if len(names) > 1:
    raise ValueError(f"config arg must be 'name', 'name,tiny' or 'tiny', got {arg!r}")
  return (names[0] if names else default), "tiny" in words


def tiny(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A variant that trains in seconds on a CPU (tests, smoke runs)."""
  config.model.update(d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                      d_ff=64)
  config.train.update(steps=20, batch_size=16, peak_lr=3e-3, warmup_steps=5, log_every=5,
                      checkpoint_every=10, bucket_window=4, length_buckets=(16, 32, 64, 128))
  config.eval.update(every=10, num_examples=32, batch_size=16)
  return config
