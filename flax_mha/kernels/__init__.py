"""The implementations behind `dot_product_attention(..., implementation=...)`.

Each takes (query [B, T, H, K], key [B, S, G, K], value [B, S, G, V], bias, mask, *, is_causal,
scale, dropout_rate, dropout_rng, mods=None) -> [B, T, H, V], already checked and flattened by
`flax_mha.attention`, and computes the same function as the oracle:

  reference  the formula on the page, untuned: what every other one is tested against
  xla        the same graph shaped for XLA: the fastest for small T·S
  rows       blocks of query rows with an exact softmax and its own backward: the fast CPU
             path for bias, mask and causality
  chunked    online softmax in tiles with its own backward: memory linear in the sequence,
             every option, tiles the masks hide skipped
  cudnn      cuDNN flash attention on NVIDIA GPUs (16-bit)
  seq_parallel  sequence-parallel over a device mesh (`flax_mha.sequence_parallel_implementation`,
             `flax_mha.ring_implementation`), by one of `ring`, `gather` (all-gather, Ulysses)

Private helpers: `_shared` (softmax dtype, row statistics), `_tiling` (chunked's tiles),
`_dropout` (the hashed keep-mask every implementation shares), `_layouts` and `_seqmods`
(sequence parallelism's token layouts and mask terms at true positions).
"""
