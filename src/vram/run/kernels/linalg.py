"""torch.linalg on the simulated GPU: what is charged and what is named (layer 4; needs torch).

CUDA's factorizations and solves (``aten/src/ATen/native/cuda/linalg/BatchLinearAlgebra.cpp``,
``BatchLinearAlgebraLib.cpp``, ``CUDASolver.cpp``) call cuSOLVER, MAGMA or cuBLAS's batched
routines. Their outputs are charged as the meta kernels shape them (column-major results, as CUDA
returns them). Beyond the outputs each call makes what the library sizes at run time: cuSOLVER's
workspace (``cusolverDn*_bufferSize``, allocated through the caching allocator,
``CUDASolver.cpp``), column-major working copies of the inputs (``cloneBatchedColumnMajor``),
pivots and info tensors, and for MAGMA's host routines (``linalg_eig``, some batched sizes)
pinned host copies. A CPU machine cannot ask cuSOLVER those sizes, so such calls are not charged
and the run names them once (`WORKSPACE`), as cuFFT's plan workspace is named.
"""
from __future__ import annotations

from typing import Any

WORKSPACE = ("torch.linalg factorizations and solves (cuSOLVER / MAGMA / batched cuBLAS, "
             "BatchLinearAlgebra.cpp): the library's workspace, column-major working copies of the "
             "inputs, pivots and infos, sized at run time; their outputs are charged")

#: aten ops that reach cuSOLVER, MAGMA or batched cuBLAS factorizations on CUDA (the composites
#: ``linalg.inv``, ``det``, ``norm``, ``eigvals``… reach these)
LINALG_OPS = frozenset({
    "linalg_cholesky_ex", "cholesky", "cholesky_solve", "cholesky_inverse",
    "linalg_lu_factor_ex", "linalg_lu", "linalg_lu_solve", "lu_unpack",
    "_linalg_solve_ex", "linalg_solve_triangular", "triangular_solve", "linalg_inv_ex",
    "_linalg_det", "_linalg_slogdet",
    "geqrf", "linalg_qr", "linalg_householder_product", "ormqr", "orgqr",
    "_linalg_eigh", "linalg_eig", "_linalg_eigvals", "_linalg_svd", "linalg_lstsq",
    "linalg_ldl_factor_ex", "linalg_ldl_solve",
})


def linalg_plan(name: str, outs: list[Any]) -> list[tuple[str, Any]] | None:
    """The outputs in order, then the named, uncharged library scratch; None for other ops."""
    if name not in LINALG_OPS:
        return None
    return [("out", i) for i in range(len(outs))] + [("note", WORKSPACE)]
