"""A run's config as its workdir records it, and the check that a resumed run keeps it.

<workdir>/config.json is the config a run trains with (experiments.generate rebuilds the model
from it), and each checkpoint records the config it was saved by (experiments.checkpoints). A run
restarted in a workdir resumes only if the settings that shape or define its checkpoints are the
saved ones (FIXED_KEYS); anything else may change: train.steps to extend a run, the optimizer
schedule, logging, evaluation, the mesh, remat. Otherwise it raises ConfigMismatch naming each
differing setting, before anything is built or written.
"""

from __future__ import annotations

import json
import os

import ml_collections

CONFIG_FILE = "config.json"  # in the workdir: the run's config, as the command line made it
# The settings a resumed run keeps: the model and the task shape the checkpoint's arrays (the
# vocabulary sizes the embeddings), and with the seed define what its steps trained on.
FIXED_KEYS = ("kind", "seed", "task", "model")
_ABSENT = "(absent)"


class ConfigMismatch(ValueError):
  """A workdir's run (or one of its checkpoints) was trained with other FIXED_KEYS settings."""


def as_dict(config: ml_collections.ConfigDict) -> dict:
  """`config` as its JSON reads back (tuples become lists), so saved and given compare alike."""
  return json.loads(config.to_json_best_effort())


def write(workdir: str, config: ml_collections.ConfigDict) -> None:
  with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
    f.write(config.to_json_best_effort(indent=2))


def load(workdir: str) -> ml_collections.ConfigDict:
  """The config a run in `workdir` was trained with."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: is {workdir} the workdir of a training run?")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def _flat(tree, prefix: str) -> dict:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for name, value in tree.items():
    out.update(_flat(value, f"{prefix}.{name}"))
  return out


def differences(saved: dict, given: ml_collections.ConfigDict) -> list[str]:
  """'key: saved (saved) != given (given)' for each FIXED_KEYS setting that differs, sorted."""
  given_dict = as_dict(given)
  out = []
  for key in FIXED_KEYS:
    old, new = _flat(saved.get(key, _ABSENT), key), _flat(given_dict.get(key, _ABSENT), key)
    for name in sorted(old.keys() | new.keys()):
      a, b = old.get(name, _ABSENT), new.get(name, _ABSENT)
      if a != b:
        out.append(f"{name}: {a if a == _ABSENT else repr(a)} (saved) != "
                   f"{b if b == _ABSENT else repr(b)} (given)")
  return out


def check_same(saved: dict, given: ml_collections.ConfigDict, what: str) -> None:
  """Raise ConfigMismatch if `given` differs from `saved` (the config `what` was trained with)
  in a FIXED_KEYS setting, naming each."""
  diffs = differences(saved, given)
  if diffs:
    raise ConfigMismatch(
        f"{what} was trained with other settings: {'; '.join(diffs)}. Resume it with the saved "
        f"settings, or train these into a new --workdir.")


def check_resume(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Raise ConfigMismatch if `workdir` holds a run (a config.json) that `config` cannot resume."""
  path = os.path.join(workdir, CONFIG_FILE)
  if os.path.exists(path):
    with open(path) as f:
      check_same(json.load(f), config, workdir)
