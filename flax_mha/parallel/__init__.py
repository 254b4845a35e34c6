"""Scale-out on JAX's SPMD engine: meshes and placement (`sharding`: data, tensor and FSDP
parallelism), sequence parallelism (`seq_parallel`: ring, all-gather and Ulysses over the mesh's
'seq' axis, with `ring` and `gather` each strategy's device-local part), its token layouts
(`layouts`) and mask terms at true positions (`seqmods`).

A layer above the kernels and `flax_mha.dispatch` (a ring step's block is the kernel the rule
chooses), below `flax_mha.attention`, which registers the "ring" implementation by importing
`seq_parallel`.
"""
