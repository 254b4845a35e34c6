"""Speculative decoding on the CPU: prompt lookup and a draft model against plain decoding,
flax_mha and transformers, greedy, at batch 1 and 8.

  python -m experiments.bench.speculative           # -> docs/speculative_cpu.md
  python -m experiments.bench.speculative --smoke   # a minute: tiny models, nothing written

Models (each read by both sides from one Hugging Face Llama checkpoint, float32):
- copy: configs/lm_copy.py's LM (4 layers, D=128) and its draft (2 layers, D=64), trained here
  on the copy task (`string BOS string`; once, into --workdir) and exported as Llama
  checkpoints (`export_llama`, checked by reading them back with `flax_mha.models.hf.load`).
  8 prompts of 48 random letters and BOS; 49 new tokens, the copy and EOS: drafts can be right.
- random: a random-weight Llama (experiments/bench/hf.py's shape at D=256, 4 layers) made by
  transformers; 8 prompts of 64 random tokens, 64 new tokens: drafts are rarely right, what
  speculation costs when it fails.
Systems: flax_mha's `decoding.generate` (plain), `speculative.generate_with_stats` with
`PromptLookup(3)` (lookup) or `DraftModel` (draft), k drafts a round; transformers' `generate`
(its default dynamic cache), with `prompt_lookup_num_tokens=k, max_matching_ngram_size=3` or
`assistant_model=` the draft (k tokens a round: a constant schedule, no confidence threshold).
transformers speculates at batch 1 only ("assisted generate is only supported for batch_size =
1"). No stop token on either side: every run makes the same number of tokens.

Each system runs in a process of its own, the processes taking turns (experiments.bench.timing);
a worker generates once per batch size untimed (compilation), then times `rounds` generations
of each, round-robin. Tokens/s is the new tokens over the median seconds of a whole generation
(prefill included); "x plain" divides it by the same library's plain decoding. Acceptance is
the drafts kept over the drafts proposed (flax_mha's `Stats`). "same tokens" compares each
system's tokens with flax_mha's plain ones (batch row 0 for transformers).

Part `costs` explains the ratios: one process times, round-robin, a step of the target through
its KV cache with 1 query and with k + 1 (the verify step), and a draft step of 1 query, after a
48-token prefill: a round costs a verify step plus, with the draft model, k draft steps.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile

import numpy as np

from experiments.bench import timing

MODULE = "experiments.bench.speculative"
BATCHES = (1, 8)
NGRAM = 3  # the n-gram prompt lookup matches, on both sides
COPY_LETTERS, COPY_NEW = 48, 49  # the copy prompts' letters; the copy and EOS
RANDOM_PROMPT, RANDOM_NEW = 64, 64
RANDOM_MODEL = dict(vocab_size=32000, hidden_size=256, intermediate_size=768,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=2048, tie_word_embeddings=False)
SMOKE_RANDOM_MODEL = dict(RANDOM_MODEL, vocab_size=256, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=2)


# ----------------------------------------------------------------------------- checkpoints

# Our parameter [layout] -> the checkpoint's tensor: the inverse of each of
# flax_mha.models.hf.TRANSFORMS that the Llama table uses.
_INVERSE = {
    "same": lambda x: x,
    "t": lambda x: x.T,  # [in, out] -> torch's Linear [out, in]
    "q": lambda x: x.reshape(x.shape[0], -1).T,  # [D, H, K] -> [H·K, D]
    "kv": lambda x: x.reshape(x.shape[0], -1).T,  # [D, G, K] -> [G·K, D]
    "o": lambda x: x.reshape(-1, x.shape[-1]).T,  # [H, K, D] -> [D, H·K]
}


def export_llama(cfg, params, directory: pathlib.Path) -> pathlib.Path:
  """A DecoderLM of Llama's architecture (`cfg`, its params) as a transformers Llama checkpoint
  in `directory`: `flax_mha.models.hf`'s Llama table read backwards. A parameter no rule takes
  is an error naming it."""
  import safetensors.numpy  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from flax import traverse_util  # pylint: disable=import-outside-toplevel
  from flax_mha.models import hf  # pylint: disable=import-outside-toplevel
  flat = {k: np.asarray(v, np.float32) for k, v in
          traverse_util.flatten_dict(params, sep="/").items()}
  tensors = {}
  for rule in hf.TABLES["llama"]:
    for i in range(cfg.num_layers) if "{i}" in rule.name else (0,):
      ours = rule.targets[0].format(i=i)
      if ours in flat:
        tensors[rule.name.format(i=i)] = np.ascontiguousarray(_INVERSE[rule.transform](
            flat.pop(ours)))
  if flat:
    raise ValueError(f"no Llama tensor takes {sorted(flat)}")
  directory.mkdir(parents=True, exist_ok=True)
  transformers.LlamaConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.k_dim, rms_norm_eps=cfg.norm.epsilon,
      rope_theta=cfg.rotary_max_wavelength, max_position_embeddings=512,
      tie_word_embeddings=cfg.tie_embeddings, pad_token_id=0, bos_token_id=1,
      eos_token_id=2).save_pretrained(directory)
  safetensors.numpy.save_file(tensors, directory / "model.safetensors", {"format": "pt"})
  return directory


def _train(config_arg: str, workdir: pathlib.Path):
  """(LMConfig, params) of configs/lm_copy.py:`config_arg` trained into `workdir` (or the
  run already there)."""
  from configs import lm_copy  # pylint: disable=import-outside-toplevel
  from experiments import generate, train  # pylint: disable=import-outside-toplevel
  if not (workdir / "config.json").is_file():
    train.train_and_evaluate(lm_copy.get_config(config_arg), str(workdir))
  runner, params = generate.restore_params(str(workdir))
  return runner.model.config, params


def copy_checkpoints(workdir: pathlib.Path, smoke: bool) -> tuple[pathlib.Path, pathlib.Path]:
  """The copy target's and draft's Llama checkpoints, trained and exported once, each checked
  by reading it back with `hf.load`."""
  from flax_mha.models import hf  # pylint: disable=import-outside-toplevel
  out = []
  for name, arg in (("target", "tiny" if smoke else None), ("draft", "draft,tiny" if smoke
                                                                 else "draft")):
    directory = workdir / f"{name}_hf"
    if not (directory / "model.safetensors").is_file():
      cfg, params = _train(arg, workdir / name)
      export_llama(cfg, params, directory)
      _, back = hf.load(directory)
      for path, a in _flat(params).items():
        np.testing.assert_array_equal(np.asarray(_flat(back["params"])[path]), np.asarray(a),
                                      err_msg=f"{directory}: {path} read back differs")
    out.append(directory)
  return out[0], out[1]


def _flat(tree) -> dict:
  from flax import traverse_util  # pylint: disable=import-outside-toplevel
  return traverse_util.flatten_dict(tree, sep="/")


def random_checkpoint(directory: pathlib.Path, smoke: bool) -> pathlib.Path:
  """A random-weight Llama, made by transformers once."""
  if (directory / "model.safetensors").is_file():
    return directory
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  config = transformers.LlamaConfig(**(SMOKE_RANDOM_MODEL if smoke else RANDOM_MODEL),
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
  transformers.LlamaForCausalLM(config).save_pretrained(directory)
  return directory


def prompts(model: str, vocab: int) -> tuple[np.ndarray, int]:
  """(8 prompts [8, L], new tokens) of `model` ("copy" or "random")."""
  rng = np.random.default_rng(1)
  if model == "copy":
    from experiments.tasks import BOS, NUM_SPECIAL  # pylint: disable=import-outside-toplevel
    letters = rng.integers(NUM_SPECIAL, NUM_SPECIAL + 26, (8, COPY_LETTERS))
    return np.concatenate([letters, np.full((8, 1), BOS)], 1).astype(np.int32), COPY_NEW
  return rng.integers(3, vocab, (8, RANDOM_PROMPT)).astype(np.int32), RANDOM_NEW


# ----------------------------------------------------------------------------- workers

def _time_calls(calls: dict, rounds: int) -> dict:
  """batch -> {seconds, tokens, stats}: calls[batch]() -> (tokens [B, N], Stats or None), once
  untimed each (compilation; its result reported), then `rounds` round-robin."""
  first = {batch: call() for batch, call in calls.items()}
  seconds = timing.round_robin(calls, rounds, warmups=0)
  out = {}
  for batch, (tokens, stats) in first.items():
    out[batch] = dict(seconds=seconds[batch], tokens=np.asarray(tokens).tolist(),
                      acceptance=None if stats is None else stats.acceptance,
                      rounds=None if stats is None else stats.rounds)
  return out


def _time_flax(directory, draft_dir, model_name: str, system: str, k: int, rounds: int) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  from flax_mha.models import decoding, hf, speculative  # pylint: disable=import-outside-toplevel
  model, variables = hf.load(directory)
  rows, new = prompts(model_name, model.config.vocab_size)
  drafter = (speculative.PromptLookup(NGRAM) if system == "lookup" else
             speculative.DraftModel(*hf.load(draft_dir)) if system == "draft" else None)

  def call(batch):
    p = rows[:batch]
    if drafter is None:
      return lambda: (jax.block_until_ready(decoding.generate(
          model, variables, (p,), p, max_new_tokens=new)), None)
    return lambda: jax.block_until_ready(speculative.generate_with_stats(
        model, variables, (p,), p, max_new_tokens=new, drafter=drafter,
        num_speculative_tokens=k))
  return _time_calls({batch: call(batch) for batch in BATCHES}, rounds)


def _time_transformers(directory, draft_dir, model_name: str, system: str, k: int,
                       rounds: int) -> dict:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(
      d, dtype=torch.float32, attn_implementation="sdpa").eval()
  model = load(directory)
  rows, new = prompts(model_name, model.config.vocab_size)
  kwargs = dict(max_new_tokens=new, do_sample=False, num_beams=1,
                eos_token_id=None, pad_token_id=0)
  if system == "hf_lookup":
    kwargs.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=NGRAM)
  elif system == "hf_draft":
    draft = load(draft_dir)
    draft.generation_config.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                                   assistant_confidence_threshold=0.0)
    kwargs.update(assistant_model=draft)

  def call(batch):
    p = torch.from_numpy(rows[:batch].astype(np.int64))
    def run():
      with torch.no_grad():
        out = model.generate(p, attention_mask=torch.ones_like(p), **kwargs)
      return out[:, p.shape[1]:].numpy(), None
    return run
  batches = BATCHES if system == "hf" else (1,)  # assisted generation: batch 1 only
  return _time_calls({batch: call(batch) for batch in batches}, rounds)


def _time_costs(directory, draft_dir, k: int, rounds: int) -> dict:
  """Seconds of one cached step: the target's with 1 and k + 1 queries, the draft's with 1."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax_mha.models import hf  # pylint: disable=import-outside-toplevel
  fns = {}
  for name, d in (("target", directory), ("draft", draft_dir)):
    model, variables = hf.load(d)
    rows, _ = prompts("copy", model.config.vocab_size)
    for batch in BATCHES:
      p = jnp.asarray(rows[:batch])
      cache = model.apply(variables, p, max_length=128, rollback=k, method="init_cache")
      _, cache = model.apply(variables, p, cache, method="logits")
      step = jax.jit(lambda v, t, c, m=model: m.apply(v, t, c, method="logits"))
      for t in (1, k + 1) if name == "target" else (1,):
        tokens = p[:, :t]
        fns[f"{name}:{t}:{batch}"] = (
            lambda s=step, v=variables, x=tokens, c=cache: jax.block_until_ready(s(v, x, c)))
  return timing.round_robin(fns, rounds, rotate=True)


def worker(case: str, directories: dict, rounds: int) -> dict:
  """A case "model:system:k" timed (see the module docstring)."""
  model_name, system, k = case.split(":")
  directory, draft_dir = directories[model_name]
  k = int(k)
  if system == "costs":
    return _time_costs(directory, draft_dir, k, rounds)
  timer = _time_transformers if system.startswith("hf") else _time_flax
  return timer(directory, draft_dir, model_name, system, k, rounds)


# ----------------------------------------------------------------------------- the report

NAMES = {"plain": "flax_mha plain", "lookup": "flax_mha prompt lookup",
         "draft": "flax_mha draft model", "hf": "transformers plain",
         "hf_lookup": "transformers prompt lookup", "hf_draft": "transformers draft model"}


SMOKE_CASES = ["copy:plain:0", "copy:draft:2", "copy:hf:0", "copy:hf_lookup:2", "random:plain:0",
               "random:lookup:2"]  # each path once


def cases(ks: list[int]) -> list[str]:
  copy = [f"copy:{s}:{k}" for k in ks for s in ("lookup", "draft", "hf_lookup", "hf_draft")]
  rand = [f"random:{s}:{k}" for k in ks for s in ("lookup", "hf_lookup")]
  return ["copy:plain:0", "copy:hf:0", *copy, "random:plain:0", "random:hf:0", *rand]


def generation(directories: dict, ks: list[int], rounds: int, turns: int,
               smoke: bool) -> list[str]:
  reports = timing.isolated(MODULE, SMOKE_CASES if smoke else cases(ks), turns=turns,
                            extra_args=["--directories", json.dumps(directories),
                                        "--rounds", str(rounds)])
  rows = [machine(), "",
          "| model | system | k | batch | acceptance | rounds | tokens/s | x plain | same tokens |",
          "|---|---|---|---|---|---|---|---|---|"]
  for case, mine in reports.items():
    model_name, system, k = case.split(":")
    plain = reports[f"{model_name}:{'hf' if system.startswith('hf') else 'plain'}:0"]
    reference = reports[f"{model_name}:plain:0"][0]
    for batch in mine[0]:
      rate, base = (_rate(rs, batch) for rs in (mine, plain))
      first = mine[0][batch]
      rows_compared = 1 if system.startswith("hf") else int(batch)
      same = first["tokens"][:rows_compared] == reference[batch]["tokens"][:rows_compared]
      acc = "-" if first["acceptance"] is None else f"{100 * first['acceptance']:.0f}%"
      rounds_done = "-" if first["rounds"] is None else str(first["rounds"])
      rows.append(f"| {model_name} | {NAMES[system]} | {k if k != '0' else '-'} | {batch} | "
                  f"{acc} | {rounds_done} | {rate:.0f} | **{rate / base:.2f}x** | "
                  f"{'yes' if same else 'no'} |")
  return rows


def machine() -> str:
  """The CPU's model name, whether it has AVX-512, and its cores (Linux: /proc/cpuinfo)."""
  with open("/proc/cpuinfo") as f:
    info = f.read()
  name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
               if line.startswith("model name")), "unknown CPU")
  avx512 = "with" if "avx512" in info else "without"
  return f"Machine: {name}, {avx512} AVX-512, {os.cpu_count()} cores."


def _rate(reports: list[dict], batch: str) -> float:
  """New tokens per second over the median of every turn's timed generations."""
  seconds = statistics.median(t for r in reports for t in r[batch]["seconds"])
  return int(batch) * len(reports[0][batch]["tokens"][0]) / seconds


def costs(directories: dict, ks: list[int], rounds: int) -> list[str]:
  """The step costs (one process, round-robin), relative to the target's 1-query step."""
  k = ks[0]
  lines = timing.run_worker([sys.executable, "-m", MODULE, "--time-case", f"copy:costs:{k}",
                             "--directories", json.dumps(directories), "--rounds", str(rounds)])
  seconds = {name: statistics.median(t) for name, t in json.loads(lines[-1]).items()}
  rows = ["| batch | target, 1 query | target, k + 1 queries | draft, 1 query |",
          "|---|---|---|---|"]
  for batch in BATCHES:
    one = seconds[f"target:1:{batch}"]
    rows.append(f"| {batch} | {1e3 * one:.2f} ms (1.00) | "
                f"{1e3 * seconds[f'target:{k + 1}:{batch}']:.2f} ms "
                f"({seconds[f'target:{k + 1}:{batch}'] / one:.2f}) | "
                f"{1e3 * seconds[f'draft:1:{batch}']:.2f} ms "
                f"({seconds[f'draft:1:{batch}'] / one:.2f}) |")
  return [f"k = {k}; median milliseconds of one jitted step through a cache holding the "
          "48-token prompt, and the ratio to the target's 1-query step:", "", *rows]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", action="append", choices=("generation", "costs"))
  parser.add_argument("--smoke", action="store_true", help="tiny models, nothing written")
  parser.add_argument("--out", default="docs/speculative_cpu.md")
  parser.add_argument("--k", type=int, action="append", help="drafts a round (default 4)")
  parser.add_argument("--workdir", default=None, help="where the models are trained and "
                      "exported (default: a scratch folder, kept: later runs reuse them)")
  parser.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--directories", default=None, help=argparse.SUPPRESS)  # a worker's
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)  # a worker's case
  args = parser.parse_args()
  rounds, turns = (1, 1) if args.smoke else (3, 2)
  if args.time_case:
    print(json.dumps(worker(args.time_case, json.loads(args.directories), args.rounds)))
    return
  workdir = pathlib.Path(args.workdir or (tempfile.mkdtemp(prefix="flax_mha_spec_") if args.smoke
                                          else os.path.join(tempfile.gettempdir(),
                                                            "flax_mha_bench_speculative")))
  target, draft = copy_checkpoints(workdir, args.smoke)
  directories = {"copy": [str(target), str(draft)],
                 "random": [str(random_checkpoint(workdir / "random_hf", args.smoke)), None]}
  ks = args.k or [4]
  sections = {"generation": lambda: generation(directories, ks, rounds, turns, args.smoke),
              "costs": lambda: costs(directories, ks, 5 if args.smoke else 50)}
  timing.write_report("Speculative decoding (CPU)", "python -m experiments.bench.speculative",
                      args.part or ["generation", "costs"], sections, args.out, args.smoke)


if __name__ == "__main__":
  main()
