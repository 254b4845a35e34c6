"""Checkpoints of a run's train state: orbax save and restore, and unreadable ones set aside.

A checkpoint holds the train state, the training seconds so far (so a resumed run's
`train_seconds` and steps/s continue where they stopped) and the config of the run that saved it.
The two newest are kept. A checkpoint that cannot be read (a save cut short, a truncated folder)
is skipped for the one before it and moved to <workdir>/checkpoints_unreadable; one saved with
other settings (experiments.run_config.FIXED_KEYS) is refused by name. With several processes
(experiments.distributed) every process saves and restores together, orbax writing each array's
shards from the process that holds them; process 0 alone moves unreadable checkpoints.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import ml_collections
import orbax.checkpoint as ocp

from experiments import distributed, run_config

CHECKPOINT_DIR = "checkpoints"  # in the workdir
UNREADABLE_DIR = "checkpoints_unreadable"  # in the workdir: checkpoints a restart skipped


def open_manager(workdir: str) -> ocp.CheckpointManager:
  """The manager of <workdir>/checkpoints, keeping the two newest (use it as a context manager)."""
  return ocp.CheckpointManager(os.path.join(workdir, CHECKPOINT_DIR),
                               options=ocp.CheckpointManagerOptions(max_to_keep=2))


def save(manager: ocp.CheckpointManager, step: int, state: Any, train_seconds: float,
         config: ml_collections.ConfigDict | None = None) -> None:
  """Save `state` as `step`, with the run's `config` (None: no record, no check on restore)."""
  meta = {"train_seconds": train_seconds}
  if config is not None:
    meta["config"] = run_config.as_dict(config)
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


def _restore(manager: ocp.CheckpointManager, step: int, state: Any):
  """`state` is the target: its tree, shapes and shardings say how to read the arrays."""
  return manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(state), meta=ocp.args.JsonRestore()))


def _first_line(error: Exception, limit: int = 200) -> str:
  text = str(error).strip().split("\n")[0]
  text = text if len(text) <= limit else text[:limit] + "..."
  return f"{type(error).__name__}: {text}"


def _set_aside(path: str, aside_dir: str) -> str:
  """Move `path` into `aside_dir` under a name not yet taken; return the new path."""
  os.makedirs(aside_dir, exist_ok=True)
  dest = base = os.path.join(aside_dir, os.path.basename(path))
  n = 1
  while os.path.exists(dest):
    dest, n = f"{base}.{n}", n + 1
  os.rename(path, dest)
  return dest


def _check_config(manager: ocp.CheckpointManager, step: int, path: str, config) -> None:
  """Raise run_config.ConfigMismatch if checkpoint `step` records a config that differs from
  `config` in a fixed setting (before its arrays are read: orbax's shape errors name none)."""
  meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  if "config" in meta:  # checkpoints saved before the record have none
    run_config.check_same(meta["config"], config, f"checkpoint {path}")


def restore_newest_readable(manager: ocp.CheckpointManager, state: Any, aside_dir: str,
                            config: ml_collections.ConfigDict | None = None):
  """(state, train_seconds) from the newest checkpoint that restores; (state, 0.0) if none exist.

  A run killed while saving, or a folder emptied or truncated later, leaves a checkpoint that
  cannot be read. Restarts skip it for the next older one and move it into `aside_dir` (kept
  for inspection): otherwise orbax, which never saves a step at or below its newest one, would
  keep the broken folder in place of the new save. Prints one line per skipped checkpoint.
  Raises RuntimeError naming the checkpoint directory when checkpoints exist but none restores,
  and run_config.ConfigMismatch (nothing moved) at the first readable checkpoint that records
  another `config` than the one given (None: no check).
  """
  skipped = []
  for step in sorted(manager.all_steps(), reverse=True):
    path = os.path.join(str(manager.directory), str(step))
    try:
      if config is not None:
        _check_config(manager, step, path, config)
      restored = _restore(manager, step, state)
    except run_config.ConfigMismatch:
      raise
    except Exception as e:  # broad: orbax raises a bare Exception for corrupt array data
      skipped.append((path, _first_line(e)))
      continue
    if skipped and distributed.is_primary():  # one process moves them; the others wait
      for bad_path, reason in skipped:
        dest = _set_aside(bad_path, aside_dir)
        print(f"skipped unreadable checkpoint {bad_path} ({reason}); moved to {dest}",
              file=sys.stderr, flush=True)
    if skipped:
      distributed.barrier("unreadable checkpoints set aside")
      manager.reload()  # forget the moved steps, so that the run saves them afresh
    return restored.state, restored.meta["train_seconds"]
  if skipped:
    details = "; ".join(f"{path}: {reason}" for path, reason in skipped)
    raise RuntimeError(
        f"no readable checkpoint in {manager.directory} (each failed to restore; a changed model "
        f"config also causes this): {details}. Move that directory away to train from scratch.")
  return state, 0.0
