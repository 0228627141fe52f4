"""Sparse layouts on the simulated GPU (COO, CSR, CSC, BSR, BSC): not modelled, refused in one line.

A CUDA build keeps a sparse tensor's indices and values in storages of their own
(``SparseCUDA``/``SparseCsrCUDA`` kernels) and its matmuls take cuSPARSE's buffers
(``cusparseSpMM_bufferSize``), sized by cuSPARSE at run time. The simulated device has no sparse
backend, so PyTorch stops with a dispatcher dump; `sparse_refusal` turns it into one line.
"""
from __future__ import annotations

import re

import torch

_SPARSE_BACKEND = re.compile(r"with arguments from the '(Sparse\w*)' backend")


def sparse_refusal(error: BaseException, what: str) -> str | None:
    """The one-line stop for an op PyTorch could not run on a simulated sparse tensor (None when
    `error` is another one)."""
    m = _SPARSE_BACKEND.search(str(error))
    if m is None or m.group(1) in ("SparseCPU", "SparseCsrCPU"):
        return None
    return sparse_message(what)


def sparse_layout(tensors: list[object]) -> bool:
    """Whether an op's outputs include a tensor of a sparse layout (``to_sparse``, ``to_sparse_csr``
    on meta make them; the simulated device cannot hold them)."""
    return any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in tensors)


def sparse_message(what: str) -> str:
    return (f"vram run: {what} makes or uses a sparse tensor on the simulated GPU, which is not modelled "
            "(its indices and values storages and cuSPARSE's buffers); keep sparse tensors on the CPU "
            "or use dense ones")
