"""Latent attention and a mixture of experts generating: flax_mha against transformers (CPU).

  python -m experiments.bench.latent_moe            # -> docs/benchmark_latent_moe_cpu.md
  python -m experiments.bench.latent_moe --smoke    # seconds: tiny models, nothing written

Two checkpoints with random weights, saved once by transformers as float32 safetensors in a
scratch directory, each of a real model's layer shapes and few layers, vocabulary 32000:
- "mla": DeepSeek-V2-Lite's attention (D=2048, 16 heads, a latent of R=512, P=64 rotary and
  N=128 other query/key features, values of 128, one query projection) in 2 layers with its
  dense MLP (10944): `deepseek_v2`, every layer dense.
- "moe": Qwen3-30B-A3B's layers (D=2048, 32 query and 4 key/value heads of 128, experts of 768,
  top 8, renormalised) with 32 experts, not 128 (so both sides fit beside each other), in 2
  layers: `qwen3_moe`.
Each case generates NEW tokens greedily after a prompt of 128 random tokens, float32, at batch
1 and 8, as `experiments.bench.hf` does (its workers: `decoding.generate` against transformers'
`generate` with sdpa attention and a static cache), each in a process of its own, the
processes in turns. Peak memory is the worker's peak resident set. "same tokens" compares batch
row 0's tokens.

The cache part counts, for the "mla" model, the bytes a token takes in every layer's cache:
flax_mha's latent cache (`DecoderLM.init_cache`), transformers' (its cache after a forward,
divided by the tokens) and the plain multi-head cache the same model would need without the
latent (keys of N + P and values of 128 for each of the 16 heads).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

import numpy as np

from experiments.bench import bf16_cpu
from experiments.bench import hf as hf_bench
from experiments.bench import timing

_COMMON = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=2,
               max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0,
               bos_token_id=1, eos_token_id=2)
MODELS = {
    "mla": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _COMMON, intermediate_size=10944, num_attention_heads=16, num_key_value_heads=16,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, first_k_dense_replace=2, n_routed_experts=64, num_experts_per_tok=6,
        moe_intermediate_size=1408, n_shared_experts=2, topk_method="greedy")),
    "moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _COMMON, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=32, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
}
SMOKE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=8, head_dim=16, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=24)
SYSTEMS = ("flax_mha", "transformers")
BATCHES = (1, 8)
NEW = 64


def make_checkpoint(directory: pathlib.Path, name: str, smoke: bool) -> pathlib.Path:
  """The random checkpoint `name` of MODELS (float32 safetensors), made by transformers once."""
  if (directory / "model.safetensors").is_file() or (
      directory / "model.safetensors.index.json").is_file():
    return directory
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  config_class, model_class, kwargs = MODELS[name]
  if smoke:
    kwargs = dict(kwargs, **{k: v for k, v in SMOKE.items() if k in kwargs})
  torch.manual_seed(0)
  config = getattr(transformers, config_class)(**kwargs)
  getattr(transformers, model_class)(config).save_pretrained(directory)
  return directory


def cache_bytes(directory) -> dict:
  """Bytes a token takes in all layers' caches: flax_mha's, transformers', a plain one's."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from flax_mha.models import hf  # pylint: disable=import-outside-toplevel
  model, _ = hf.load(directory)
  tokens = np.zeros((1, 16), np.int32)
  ours = sum(x.nbytes for c in model.init_cache(tokens, 16) for x in (c.key, c.value)) / 16
  theirs_model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
  with torch.no_grad():
    out = theirs_model(input_ids=torch.from_numpy(tokens.astype(np.int64)) + 3, use_cache=True)
  theirs = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers
               for t in (layer.keys, layer.values)) / 16
  cfg = model.config
  plain = cfg.num_layers * cfg.num_heads * (cfg.mla.qk_dim + cfg.mla.v_dim) * 4
  return dict(flax_mha=ours, transformers=theirs, plain=plain,
              latent=cfg.num_layers * (cfg.mla.kv_rank + cfg.mla.rope_dim) * 4)


def _cases(models) -> list[str]:
  return [f"{m}:{s}:{b}" for m in models for b in BATCHES for s in SYSTEMS]


def generation(directories: dict, turns: int, rounds: int, new: int, extra: list[str]):
  cases = _cases(directories)
  reports = {}
  for name, directory in directories.items():
    reports.update(timing.isolated(
        "experiments.bench.latent_moe", [c for c in cases if c.startswith(name + ":")],
        turns=turns, extra_args=["--checkpoint", str(directory), *extra]))
  rows = ["| model | batch | flax_mha tokens/s | transformers tokens/s | ratio | flax_mha peak "
          "MiB | transformers peak MiB | same tokens |", "|---|---|---|---|---|---|---|---|"]
  for name in directories:
    for batch in BATCHES:
      rows.append(hf_bench.comparison_row(name, batch, new, *(reports[f"{name}:{s}:{batch}"]
                                                              for s in SYSTEMS)))
  return rows


def caches(directory, extra: list[str]) -> list[str]:
  lines = timing.run_worker([sys.executable, "-m", "experiments.bench.latent_moe",
                             "--time-case", "cache", "--checkpoint", str(directory), *extra])
  r = json.loads(lines[-1])
  share = lambda x: f"{x:.0f} | {x / r['plain']:.1%}"
  return ["Bytes a token takes in the caches of all layers of the \"mla\" model (float32):", "",
          "| cache | bytes a token | share of the plain cache |", "|---|---|---|",
          f"| plain multi-head (keys and values of every head) | {share(r['plain'])} |",
          f"| flax_mha's latent cache (keys R + P, values R) | {share(r['flax_mha'])} |",
          f"| transformers' latent cache | {share(r['transformers'])} |",
          f"| the latent alone (R + P) | {share(r['latent'])} |"]


def worker(case: str, checkpoint, rounds: int, new: int):
  """A worker's report for `case`: 'cache', or 'model:system:batch'."""
  if case == "cache":
    return cache_bytes(checkpoint)
  _, system, batch = case.split(":")
  timer = hf_bench.time_flax if system == "flax_mha" else hf_bench.time_transformers
  return timer(checkpoint, "float32", int(batch), rounds, new)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", action="append", choices=("generation", "cache"))
  parser.add_argument("--smoke", action="store_true", help="tiny models, nothing written")
  parser.add_argument("--out", default="docs/benchmark_latent_moe_cpu.md")
  parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)  # a worker's
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  rounds, turns, new = (1, 1, 4) if args.smoke else (2, 2, NEW)
  if args.time_case:
    print(json.dumps(worker(args.time_case, args.checkpoint, rounds, new)))
    return
  root = pathlib.Path(tempfile.mkdtemp(prefix="flax_mha_bench_") if args.smoke else
                      os.path.join(tempfile.gettempdir(), "flax_mha_bench_latent_moe"))
  directories = {name: make_checkpoint(root / name, name, args.smoke) for name in MODELS}
  extra = ["--smoke"] if args.smoke else []
  load_before = os.getloadavg()
  sections = {
      "generation": lambda: bf16_cpu.machine(load_before) + generation(
          directories, turns, rounds, new, extra),
      "cache": lambda: caches(directories["mla"], extra)}
  timing.write_report("Latent attention and experts generating (CPU)",
                      "python -m experiments.bench.latent_moe",
                      args.part or ["generation", "cache"], sections, args.out, args.smoke)


if __name__ == "__main__":
  main()
