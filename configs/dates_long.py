"""Dates -> ISO 8601, trained longer for >= 99.5% held-out exact match.

  python -m experiments.train --config configs/dates_long.py --workdir runs/dates_long
  python -m experiments.train --config configs/dates_long.py:tiny --workdir runs/dates_long_tiny
"""

from configs import common


def get_config(arg: str | None = None):
  config = common.base_config("dates", heldout_percent=10)
  config.train.steps = 5000
  config.eval.num_examples = 2000
  if arg not in (None, "tiny"):
    raise ValueError(f"config arg must be 'tiny' or absent, got {arg!r}")
  return common.tiny(config) if arg == "tiny" else config
