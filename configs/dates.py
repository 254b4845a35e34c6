"""Dates in 8 locales x 14 formats, random case -> ISO 8601: the default experiment.

  python -m experiments.train --config configs/dates.py --workdir runs/dates
  python -m experiments.train --config configs/dates.py:tiny --workdir runs/dates_tiny
"""

from configs import common


def get_config(arg: str | None = None):
  config = common.base_config("dates", heldout_percent=10)
  if arg not in (None, "tiny"):
    raise ValueError(f"config arg must be 'tiny' or absent, got {arg!r}")
  return common.tiny(config) if arg == "tiny" else config
