"""Metric rows to <workdir>/metrics.jsonl and TensorBoard (tensorboardX, no TensorFlow)."""

from __future__ import annotations

import json
import os

import tensorboardX

METRICS_FILE = "metrics.jsonl"


def read_rows(workdir: str) -> list[dict]:
  """The rows of <workdir>/metrics.jsonl ([] if absent)."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


class MetricWriter:
  """Appends {'step': s, **scalars} rows; a resumed run first drops rows after its checkpoint."""

  def __init__(self, workdir: str, resume_step: int):
    kept = [r for r in read_rows(workdir) if r["step"] <= resume_step]
    self._path = os.path.join(workdir, METRICS_FILE)
    with open(self._path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, scalars: dict[str, float]) -> None:
    row = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    with open(self._path, "a") as f:
      f.write(json.dumps(row) + "\n")
    for name, value in scalars.items():
      self._tb.add_scalar(name, float(value), int(step))

  def close(self) -> None:
    self._tb.close()


class NoWriter:
  """A MetricWriter that writes nothing: what every process but the first gets."""

  def write(self, step: int, scalars: dict[str, float]) -> None:
    del step, scalars

  def close(self) -> None:
    pass
