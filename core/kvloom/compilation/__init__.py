"""torch.compile for kvloom models: the attention custom op (``attention_op``), the
piecewise compilation backend (``backend``), the CUDA-graph wrapper of a piece or a whole
forward (``cuda_graph``) and the on-disk compile cache (``cache``). docs/cuda_graphs.md
describes how they fit together."""
