"""Triton kernels. `int4_matmul` is the one launcher every INT4 layer calls."""

from sdsie.kernels.int4_gemm import Int4KernelConfig, candidate_configs, int4_matmul, kernel_calls, select_config
from sdsie.kernels.reference import int4_matmul_reference

__all__ = [
    "Int4KernelConfig",
    "candidate_configs",
    "int4_matmul",
    "int4_matmul_reference",
    "kernel_calls",
    "select_config",
]
