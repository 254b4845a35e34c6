"""Hugging Face checkpoints (safetensors) into flax_mha's decoder, without torch.

  model, variables = hf.load("path/to/checkpoint")          # linen DecoderLM and its params
  module = hf.load_nnx("path/to/checkpoint")                # the NNX DecoderLM, state loaded
  tokens = flax_mha.models.decoding.generate(model, variables, (prompts,), prompts, lengths,
                                             max_new_tokens=32)

A checkpoint directory holds `config.json` and `model.safetensors`, or shards listed by
`model.safetensors.index.json`. The family comes from config.json's model_type
(`flax_mha.models.hf_config` turns the config into an `LMConfig`); the tensors are read one at
a time from the memory-mapped files, each mapped by its family's table below (the checkpoint's
name, our parameter paths, a transform as data), cast, and placed (on a mesh by the model's
sharding rules, `flax_mha.models.lm.PARAM_AXES`), so the host holds about one tensor beyond
what is placed (a mixture of experts' per-expert tensors are gathered into their stacked
parameter [X, ...] first: one such parameter). A tensor that no rule matches, a parameter that
no tensor fills, and a tensor of the wrong shape are refused by name: nothing is guessed. A
file that cannot be read (cut short, not JSON, lacking a key) is a `CheckpointError`, a
ValueError naming the file, and the shard where there are several.

Needs the `hf` extra (safetensors; tokenizers for `load_tokenizer`). Dimension key: D d_model,
H heads, G kv heads, K head dim, F MLP width, C vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import traverse_util

from flax_mha.parallel import sharding as sharding_lib
from flax_mha.models import lm
from flax_mha.models import lm_nnx
from flax_mha.models.hf_config import config_from_hf, family
from flax_mha.models.hf_tables import PREFIX, TABLES, TRANSFORMS, Rule, ignored


class CheckpointError(ValueError):
  """A checkpoint file that cannot be read, or whose config the decoder cannot take: the
  message names the file (and the shard of a sharded checkpoint)."""


def load(directory, *, dtype=None, mesh=None, **overrides):
  """(the linen `DecoderLM`, its variables {'params': ...}) of the checkpoint in `directory`.

  dtype: the parameters' and the computation's, one of `hf_config.LOAD_DTYPES` (default: the
    checkpoint's, so a bfloat16 one stays bfloat16; float64 only under jax_enable_x64). mesh: a
    `jax.sharding.Mesh` (`flax_mha.parallel.sharding.make_mesh`): each parameter is placed as the model's
    sharding rules say as it is read. overrides: other `LMConfig` fields (e.g.
    attention_implementation).

  Raises FileNotFoundError for a missing config.json, weights file or shard;
  `hf_config.UnsupportedDtype` (a TypeError) for another dtype; `CheckpointError` (a ValueError)
  naming the file for one that cannot be read (cut short, not JSON) and for a config.json the
  decoder cannot take (a missing key, an unsupported setting); ValueError naming the tensor for
  weights that do not fit the config.
  """
  directory = pathlib.Path(directory)
  config = read_config(directory)
  try:
    cfg = config_from_hf(config, dtype=dtype)
  except ValueError as e:  # what config.json says (or lacks), not the overrides
    raise CheckpointError(f"{directory / 'config.json'}: {e}") from None
  cfg = dataclasses.replace(cfg, **overrides)
  model = lm.DecoderLM(cfg)
  abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
  want = traverse_util.flatten_dict(abstract["params"], sep="/")
  places = {}
  if mesh is not None:
    places = traverse_util.flatten_dict(
        sharding_lib.shardings_for(abstract["params"], mesh, lm.PARAM_AXES), sep="/")
  params = read_params(directory, family(config), cfg, want, places)
  return model, {"params": traverse_util.unflatten_dict(params, sep="/")}


def load_nnx(directory, *, dtype=None, mesh=None, **overrides) -> lm_nnx.DecoderLM:
  """The NNX `DecoderLM` of the checkpoint in `directory`, its state loaded (arguments as
  `load`'s); no random initialisation runs."""
  model, variables = load(directory, dtype=dtype, mesh=mesh, **overrides)
  module = nnx.eval_shape(lambda: lm_nnx.DecoderLM(model.config, rngs=nnx.Rngs(0)))
  state = nnx.state(module, nnx.Param)
  nnx.replace_by_pure_dict(state, variables["params"])
  nnx.update(module, state)
  return module


def read_config(directory) -> dict:
  """config.json of a checkpoint directory, as a dict. Raises FileNotFoundError when it is
  absent, CheckpointError naming it when it is not a JSON object."""
  path = pathlib.Path(directory) / "config.json"
  if not path.is_file():
    raise FileNotFoundError(f"no config.json in {directory}: a checkpoint directory holds "
                            "config.json and model.safetensors (or its shards and index)")
  return _read_json(path)


def _read_json(path: pathlib.Path) -> dict:
  """The JSON object in the file `path`; CheckpointError naming the file (and the line and
  column of a syntax error) when it holds anything else."""
  try:
    value = json.loads(path.read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column "
                          f"{e.colno} (a file cut short or edited by hand?)") from None
  except UnicodeDecodeError as e:
    raise CheckpointError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): "
                          "expected JSON") from None
  if not isinstance(value, dict):
    raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, expected an object")
  return value


def tensor_files(directory) -> list[pathlib.Path]:
  """The safetensors files of a checkpoint: the shards its index names, or model.safetensors.

  Raises FileNotFoundError for no weights or a shard the index names that is absent (naming it);
  CheckpointError naming the index when it is not JSON or lacks its weight_map.
  """
  directory = pathlib.Path(directory)
  index = directory / "model.safetensors.index.json"
  if index.is_file():
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(name, str)
                                                   for name in weight_map.values()):
      raise CheckpointError(f"{index}: expected the key 'weight_map', a mapping of tensor names "
                            f"to shard files, got {weight_map!r:.80}")
    files = [directory / name for name in sorted(set(weight_map.values()))]
    for number, path in enumerate(files, 1):
      if not path.is_file():
        raise FileNotFoundError(f"{_shard(number, len(files), path)}, named by {index}, is "
                                "missing")
    return files
  single = directory / "model.safetensors"
  if not single.is_file():
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in "
                            f"{directory} (torch .bin checkpoints are not read: no torch here)")
  return [single]


def read_params(directory, fam: str, cfg: lm.LMConfig, want: dict, places: dict) -> dict:
  """{our path: array} for every path of `want` (path -> ShapeDtypeStruct), read tensor by
  tensor through the family's table and placed by `places` (path -> sharding; default device
  otherwise). A file that safetensors cannot read is a CheckpointError naming it and its shard."""
  rules = [(_pattern(rule.name), rule) for rule in TABLES[fam]]
  got, stacks = {}, {}
  files = tensor_files(directory)
  for number, path in enumerate(files, 1):
    where = _shard(number, len(files), path)
    with _safetensors(path, where) as f:
      names = list(f.keys())
    for name in names:
      short = name.removeprefix(PREFIX.get(fam, ""))
      if ignored(fam, short, cfg.num_layers):
        continue
      rule, index = _rule_for(name, short, rules, fam)
      targets = [target.replace("{i}", index.get("i", "")) for target in rule.targets]
      # The file mapped for one tensor at a time: the pages read count in the resident set
      # while mapped, so a mapping held across the load would add the whole checkpoint.
      with _safetensors(path, where) as f:
        tensor = f.get_tensor(name)
      for target, array in zip(targets, _transform(rule, tensor, name, targets, cfg, want)):
        if rule.stack:
          _stack(stacks, got, target, int(index["e"]), array, name, want, places)
        else:
          _place(got, target, array, name, want, places)
      del tensor
  missing = sorted(set(want) - set(got))
  if missing:
    partial = {t: sorted(set(range(want[t].shape[0])) - filled)
               for t, (_, filled) in sorted(stacks.items())}
    raise ValueError(f"the checkpoint in {directory} lacks tensors for {len(missing)} "
                     f"parameters of its {fam} config, e.g. {missing[:6]} (each filled by "
                     f"{_filled_by(missing[0], fam)})"
                     + (f"; experts missing: {partial}" if partial else ""))
  return got


def _shard(number: int, count: int, path: pathlib.Path) -> str:
  """How messages name a weights file: 'shard 2 of 3, <path>' when there are several."""
  return f"shard {number} of {count}, {path}" if count > 1 else str(path)


@contextlib.contextmanager
def _safetensors(path: pathlib.Path, where: str):
  """The safetensors file `path` opened for NumPy; what safetensors refuses to read in it
  (at opening or at a tensor) raised as a CheckpointError naming `where`."""
  from safetensors import SafetensorError, safe_open  # the `hf` extra: imported where used

  try:
    with safe_open(str(path), framework="numpy") as f:
      yield f
  except SafetensorError as e:
    raise CheckpointError(f"{where} cannot be read as safetensors ({e}): expected a complete "
                          "safetensors file, found a truncated or corrupt one") from None


def _pattern(name: str) -> re.Pattern:
  return re.compile(re.escape(name).replace(r"\{i\}", r"(?P<i>\d+)").replace(
      r"\{e\}", r"(?P<e>\d+)"))


def _rule_for(name: str, short: str, rules, fam: str):
  """(the one rule matching tensor `short`, its indices {'i': layer, 'e': expert} as strings)."""
  hits = [(rule, m) for pattern, rule in rules if (m := pattern.fullmatch(short))]
  if len(hits) != 1:
    raise ValueError(f"tensor {name!r} matches {len(hits)} rules of the {fam} table "
                     f"{[rule.name for rule, _ in hits]}: an unexpected tensor (a family this "
                     "loader does not read, or an architecture variant it does not implement)")
  rule, m = hits[0]
  return rule, m.groupdict()


def _transform(rule: Rule, tensor, name: str, targets: list[str], cfg, want: dict):
  """The rule's transform of `tensor`, a tensor that cannot take it refused by name."""
  try:
    return TRANSFORMS[rule.transform](tensor, cfg)
  except ValueError as e:  # a reshape or split that the tensor's shape does not allow
    wants = {t: tuple(want[t].shape) for t in targets if t in want}
    raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, which does not give "
                     f"the parameters {wants} of its config ({e})") from None


def _place(got: dict, target: str, array, name: str, want: dict, places: dict) -> None:
  """Check `array` against the parameter `target`, cast it and place it in `got`."""
  if target not in want:
    raise ValueError(f"tensor {name!r} fills parameter {target!r}, which its config does not "
                     "have: an unexpected tensor (e.g. an untied lm_head for tied embeddings, "
                     "biases the config says are absent, a layer past num_hidden_layers)")
  spec = want[target]
  if tuple(array.shape) != tuple(spec.shape):
    raise ValueError(f"tensor {name!r} gives parameter {target!r} shape {tuple(array.shape)}, "
                     f"its config wants {tuple(spec.shape)}")
  if target in got:
    raise ValueError(f"parameter {target!r} is filled twice (again by {name!r})")
  array = np.ascontiguousarray(array, dtype=spec.dtype)
  got[target] = jax.device_put(array, places.get(target))


def _stack(stacks: dict, got: dict, target: str, row: int, array, name: str, want: dict,
           places: dict) -> None:
  """One expert's `array` into row `row` of the stacked parameter `target` (a host buffer in
  `stacks`), placed in `got` once every row is filled."""
  if target not in want:
    _place(got, target, array, name, want, places)  # refused by name there
  spec = want[target]
  if row >= spec.shape[0] or tuple(array.shape) != tuple(spec.shape[1:]):
    raise ValueError(f"tensor {name!r} gives expert {row} of parameter {target!r} shape "
                     f"{tuple(array.shape)}, its config wants {spec.shape[0]} experts of "
                     f"{tuple(spec.shape[1:])}")
  buffer, filled = stacks.setdefault(target, (np.empty(spec.shape, spec.dtype), set()))
  if row in filled or target in got:
    raise ValueError(f"expert {row} of parameter {target!r} is filled twice (again by {name!r})")
  buffer[row] = array
  filled.add(row)
  if len(filled) == spec.shape[0]:
    _place(got, target, buffer, name, want, places)
    del stacks[target]


def _filled_by(path: str, fam: str) -> str:
  """The checkpoint tensor name that fills our parameter `path`, for error messages."""
  layer = re.search(r"block_(\d+)/", path)
  for rule in TABLES[fam]:
    for target in rule.targets:
      if re.sub(r"block_\d+/", "block_{i}/", path) == target:
        return repr(PREFIX.get(fam, "") + rule.name.replace("{i}", layer.group(1) if layer
                                                              else "{i}"))
  return "no rule"


def load_tokenizer(directory):
  """The `tokenizers.Tokenizer` of the checkpoint's tokenizer.json (the `hf` extra). Raises
  FileNotFoundError when it is absent, CheckpointError naming it when tokenizers cannot read it."""
  from tokenizers import Tokenizer  # the `hf` extra: imported where it is used

  path = pathlib.Path(directory) / "tokenizer.json"
  if not path.is_file():
    raise FileNotFoundError(f"no tokenizer.json in {directory}")
  try:
    return Tokenizer.from_file(str(path))
  except Exception as e:  # pylint: disable=broad-except  (tokenizers raises a bare Exception)
    raise CheckpointError(f"{path} cannot be read as a tokenizer ({e}): expected the "
                          "tokenizer.json that transformers saves") from None


def stop_tokens(directory) -> tuple[int, ...]:
  """The end-of-sequence ids of generation_config.json, else config.json (eos_token_id: an int,
  a list of ints or absent). Raises CheckpointError naming the file when it is not a JSON
  object or its eos_token_id is anything else."""
  directory = pathlib.Path(directory)
  for name in ("generation_config.json", "config.json"):
    path = directory / name
    if path.is_file():
      eos = _read_json(path).get("eos_token_id")
      if eos is not None:
        ids = tuple(eos) if isinstance(eos, list) else (eos,)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
          raise CheckpointError(f"{path}: eos_token_id must be an int or a list of ints, got "
                                f"{eos!r}")
        return ids
  return ()
