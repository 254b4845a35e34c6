"""English number words (n < 10**6) -> German digit grouping ("123.456") or German number words.

  python -m experiments.train --config configs/num2words_de.py --workdir runs/num2words_de
  python -m experiments.train --config configs/num2words_de.py:words --workdir runs/n2w_words
  python -m experiments.train --config configs/num2words_de.py:tiny --workdir runs/n2w_tiny
  (arg: "digits" (default) or "words", and/or "tiny", comma-separated)
"""

from configs import common


def get_config(arg: str | None = None):
  target, is_tiny = common.parse_arg(arg, "digits")
  if target not in ("digits", "words"):
    raise ValueError(f"target must be 'digits' or 'words', got {target!r}")
  config = common.base_config("num2words_de", target=target, max_value=10**6,
                              heldout_percent=10)
  config.train.steps = 2000
  return common.tiny(config) if is_tiny else config
