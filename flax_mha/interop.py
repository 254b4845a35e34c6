"""Parameter conversion from PyTorch. torch is never imported: tensors are read through numpy."""

from __future__ import annotations

import numpy as np


def from_torch_multihead_attention(state_dict, num_heads: int) -> dict:
  """Params for `flax_mha.MultiHeadAttention` that reproduce a `torch.nn.MultiheadAttention`.

  Args:
    state_dict: the torch module's `state_dict()` (tensors or arrays), with packed
      `in_proj_weight` or separate `q/k/v_proj_weight` (kdim/vdim != embed_dim), `out_proj`, and
      biases (`in_proj_bias`, `out_proj.bias`) unless the module was built with `bias=False`.
    num_heads: the torch module's `num_heads`.

  Returns:
    {'params': {'query'|'key'|'value'|'out': {'kernel', 'bias'}}} for
    `MultiHeadAttention(num_heads)`; call it with batch-first inputs. From a `bias=False` module
    the entries hold only 'kernel': build `MultiHeadAttention(num_heads, use_bias=False)`.
  """
  sd = {k: _to_numpy(v) for k, v in state_dict.items()}
  if "out_proj.weight" not in sd:
    raise ValueError(f"state_dict has no 'out_proj.weight'; keys: {sorted(sd)}")
  embed = sd["out_proj.weight"].shape[0]
  if not isinstance(num_heads, int) or num_heads <= 0 or embed % num_heads:
    raise ValueError(
        f"num_heads must be a positive divisor of embed_dim={embed}, got {num_heads!r}")
  if "bias_k" in sd or "bias_v" in sd:
    raise ValueError("add_bias_kv=True is not supported: its extra key/value have no equivalent")
  if "in_proj_weight" in sd:
    weights = np.split(sd["in_proj_weight"], 3, axis=0)
  else:
    weights = [sd[f"{n}_proj_weight"] for n in "qkv"]
  use_bias = "in_proj_bias" in sd
  if use_bias != ("out_proj.bias" in sd):  # torch's `bias` flag sets both or neither
    raise ValueError(
        "state_dict must hold both 'in_proj_bias' and 'out_proj.bias' (bias=True) or neither "
        f"(bias=False), got keys {sorted(sd)}")
  biases = np.split(sd["in_proj_bias"], 3) if use_bias else [None] * 3
  head = embed // num_heads
  params = {}
  for name, w, b in zip(("query", "key", "value"), weights, biases):
    params[name] = {"kernel": w.T.reshape(w.shape[1], num_heads, head)}
    if use_bias:
      params[name]["bias"] = b.reshape(num_heads, head)
  params["out"] = {"kernel": sd["out_proj.weight"].T.reshape(num_heads, head, embed)}
  if use_bias:
    params["out"]["bias"] = sd["out_proj.bias"]
  return {"params": params}


def _to_numpy(x):
  if hasattr(x, "detach"):  # a torch tensor
    x = x.detach().cpu().numpy()
  return np.asarray(x)
