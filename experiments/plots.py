"""PNG plots: learning curves from metric rows, attention maps per head."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)
import numpy as np  # noqa: E402


def learning_curves(rows: list[dict], path: str) -> None:
  """Training loss and held-out accuracies against step."""
  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
  for ax, names in ((ax_loss, ("train/loss", "eval/loss")),
                    (ax_acc, ("eval/token_accuracy", "eval/exact_match"))):
    for name in names:
      points = [(r["step"], r[name]) for r in rows if name in r]
      if points:
        ax.plot(*zip(*points), marker="." if name.startswith("eval") else None, label=name)
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
  ax_loss.set_yscale("log")
  ax_acc.set_ylim(0, 1.02)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def attention_maps(weights_HTS: np.ndarray, query_labels: list[str], key_labels: list[str],
                   title: str, path: str) -> None:
  """One heat map per head: rows are queries [T], columns keys [S], labelled by character."""
  h, t, s = weights_HTS.shape
  if (t, s) != (len(query_labels), len(key_labels)):
    raise ValueError(f"weights [H, T, S] = {weights_HTS.shape} need {t} query and {s} key labels, "
                     f"got {len(query_labels)} and {len(key_labels)}")
  size = 0.5 + 0.22 * max(t, s)
  fig, axes = plt.subplots(1, h, figsize=(h * size, size + 0.6), squeeze=False)
  for head, ax in enumerate(axes[0]):
    ax.imshow(weights_HTS[head], cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(s), key_labels, fontsize=7)
    ax.set_yticks(range(t), query_labels, fontsize=7)
    ax.set_title(f"head {head}", fontsize=9)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
