"""Small algorithmic tasks for quick runs: copy, reverse, sort, addition.

  python -m experiments.train --config configs/algorithmic.py:reverse --workdir runs/reverse
  python -m experiments.train --config configs/algorithmic.py:addition,tiny --workdir runs/add
  (arg: copy (default), reverse, sort or addition, and/or "tiny", comma-separated)
"""

from configs import common

_KWARGS = {
    "copy": dict(min_len=1, max_len=16),
    "reverse": dict(min_len=1, max_len=16),
    "sort": dict(min_len=1, max_len=16),
    "addition": dict(max_digits=4),
}


def get_config(arg: str | None = None):
  task, is_tiny = common.parse_arg(arg, "copy")
  if task not in _KWARGS:
    raise ValueError(f"task must be one of {sorted(_KWARGS)}, got {task!r}")
  config = common.base_config(task, heldout_percent=10, **_KWARGS[task])
  config.model.update(d_model=64, d_ff=256)
  config.train.steps = 1000
  return common.tiny(config) if is_tiny else config
