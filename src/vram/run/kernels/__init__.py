"""What each CUDA kernel allocates beyond its outputs, and in which order, from PyTorch's CUDA
source (``aten/src/ATen/native/cuda``, ``cudnn``, ``transformers/cuda``). Pure rules: a kernel's
plan is a list of ``("out", i)`` / ``("tmp", nbytes)`` / ``("free", k)`` steps that the engine
carries out on the simulated allocator.

- `plan`: `op_plan`, the table from an aten op to its plan (losses, ``_foreach_norm``, scalar
  bases), the uncharged-scratch notes, Python-level functions seen whole.
- `blas`: cuBLAS and cuBLASLt: the per-handle workspaces, the operand copies of mm/bmm.
- `cudnn`: cuDNN batch norm (which backend runs, which outputs it makes), cuDNN's plans, RNN refusal.
- `cudnn_conv`: cuDNN convolutions and training batch norm: output layout, workspaces, the survivable
  workspace OOM; `cudnn_sm90`: the workspaces measured on an H200.
- `autocast`: CUDA autocast's cast policy (lower precision, float32, promote, banned).
- `reductions`: the staging buffers and semaphores of ``Reduce.cuh``'s reductions.
- `scratch`: embedding backward's sort path, layer-norm / RMS-norm backward's partial sums.
- `embedding_bag`: ``embedding_bag``'s forward output order and its backward (sort, segments).
- `sorting`: sort / argsort, topk, cumsum / cumprod, multinomial, nonzero, scatter_reduce(mean): their
  copies, index and key buffers; cub's temporary storage and the ops not modelled
  (index_reduce…) named, not charged.
- `selection`: median / nanmedian / kthvalue / mode (contiguous copies, ``median()``'s sort) and
  multinomial with replacement (its distribution buffers).
- `unique`: torch.unique's worst-case outputs (their storage as CUDA leaves it) and sort buffers;
  ``unique(dim=...)``'s row copy and index buffers.
- `sdpa`: ``scaled_dot_product_attention``: which backend ``sdp_utils.cpp`` picks, what it
  allocates forward and backward.
- `cufft`: ``torch.fft`` as ``SpectralOps.cpp`` runs it (copies, clones; the workspace named);
  `cufft_half`: its composites for float16 / complex32 inputs, which CUDA alone accepts.
- `indexing`: ``x[idx]`` / ``x[idx] = v`` (``make_info``'s index copies) and ``index_put_(accumulate=True)``
  (``x[idx]``'s backward, a user's put): masks' nonzero, the range check, linear indices, their sort.
- `ctc`: CTC loss forward and backward (``LossCTC.cu``), the refusal of cuDNN's CTC kernel.
- `histograms`: ``bincount`` / ``histc`` (``SummaryOps.cu``): the extrema read to the host.
- `scans`: ``cummax`` / ``cummin``'s helpers (no meta kernel in torch), their copies.
- `linalg`: ``torch.linalg``'s factorizations: outputs charged, cuSOLVER's run-time scratch named.
- `sparse`: sparse COO/CSR/BSR tensors: which sparse kernels CUDA shares with the CPU, ``_coalesce``,
  sparse ``addmm`` and CSR <-> CSC step by step (Thrust's and cuSPARSE's buffers named);
  `sparse_ops`: sparse ``add``, ``index_select``, ``sparse_mask``, ``torch.sparse.sum``'s backward.
- `grouped_mm`: ``torch._grouped_mm`` as ``GroupedBlas.cpp`` runs it.
- `vision`: torchvision's ``nms`` (its sort, sorted boxes and suppression mask).
- `fastpath`: ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` inference fast paths.

Imported by `vram.run.engine` and `vram.run.runtime`; imports `vram.run.values` (the fast paths'
known masks) and nothing else of the run floor.
"""
