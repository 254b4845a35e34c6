"""The implementations behind `dot_product_attention(..., implementation=...)`.

Each is one module that registers one `registry.Kernel` (its name, its function, what it
refuses): importing this package registers them all, in the order below, which is the order of
`registry.names()` and `flax_mha.IMPLEMENTATIONS`. Every one computes the same function as the
oracle:

  reference  the formula on the page, untuned: what every other one is tested against
  xla        the same graph shaped for XLA: the fastest for small T·S
  chunked    online softmax in tiles with its own backward: memory linear in the sequence,
             every option, tiles the masks hide skipped; its tile pieces (`Config`,
             `tile_context`, `forward_tile`, `initial_stats`) are the online softmax that
             `decode` and `flax_mha.cache.paged` run too
  rows       blocks of query rows with an exact softmax and its own backward: the fast CPU
             path for bias, mask, causality and windows
  cudnn      cuDNN flash attention on NVIDIA GPUs (16-bit)
  splash     JAX's splash attention on TPUs (Pallas): static masks as block sparsity,
             segment ids, lengths, soft cap, sinks; `make_attention(interpret=True)` runs it
             on any platform (the tests' CPU check)
  triton     flax_mha's flash attention on NVIDIA GPUs (Pallas Triton), for what cuDNN
             refuses: masks, windows, lengths, positions, bias with its gradient, mask/score
             functions of indices; `make_attention(interpret=True)` runs it anywhere
  decode     a few queries over a long cache: keys split, merged by log-sum-exp

and, registered by `flax_mha.attention` after these (it loads `flax_mha.parallel`, a layer up):

  ring       (`flax_mha.parallel.seq_parallel`) sequence-parallel over the context mesh's 'seq'
             axis; other strategies (all-gather, Ulysses) through
             `flax_mha.sequence_parallel_implementation`

What `implementation=None` picks among them is the rule in `flax_mha.dispatch`.

Internal modules the implementations share (public to the package, no kernel of their own):
`common` (the numerics and argument handling every implementation shares), `dropout` (the
hashed keep-mask), `confine` (`flax_mha.confine_nonfinite`'s mechanism), `tiling` (the tiles of
chunked and decode), `triton_tiles` (the Pallas kernels behind triton), `layouts` and `seqmods`
(sequence parallelism's token layouts and mask terms at true positions).
"""

from flax_mha.kernels import registry
from flax_mha.kernels import reference
from flax_mha.kernels import xla
from flax_mha.kernels import chunked
from flax_mha.kernels import rows
from flax_mha.kernels import cudnn
from flax_mha.kernels import splash
from flax_mha.kernels import triton
from flax_mha.kernels import decode

__all__ = ["registry", "reference", "xla", "chunked", "rows", "cudnn", "splash", "triton", "decode"]
