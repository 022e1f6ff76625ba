"""Triton kernels. `int4_matmul` is the one launcher every INT4 layer calls (`int4_mm`: the same as a torch.library
op, which torch.compile traces); `int4_silu_mul` is a fused gate/up projection's, with silu(gate) * up in its
epilogue. On sm_90+ both run bf16 calls of M <= 8 on most decoder shapes through `int4_mma`'s tensor-core GEMV
(weights repacked to mma fragment order on first use); `fuse_rmsnorm` swaps a model's RMSNorms for one kernel each
(`rms_norm`); `decode_attention` is split-KV attention for a one-token step (`sdsie::decode_attention` as an op);
`logit_stats` is the argmax and entropy of logits in one pass. `tune` / `tune_model` (`sdsie tune-int4`) time the
INT4 choice's candidates on this GPU and keep the fastest per shape in a local cache the choice reads first."""

from sdsie.kernels.decode_attention import decode_attention, split_rule
from sdsie.kernels.int4_config import Int4KernelConfig, candidate_configs, select_config
from sdsie.kernels.int4_gemm import (
    check_squares_dtype,
    compose_epilogue,
    epilogue_max_m,
    int4_matmul,
    int4_silu_mul,
    kernel_calls,
    norm_factor,
    norm_stream_width,
    refresh_choice,
    row_squares,
    silu_mul_halves,
    squares_width,
)
from sdsie.kernels.int4_tune import tune, tune_model
from sdsie.kernels.logit_stats import logit_stats
from sdsie.kernels.ops import int4_mm, register_weight
from sdsie.kernels.reference import int4_matmul_reference
from sdsie.kernels.rmsnorm import FusedRMSNorm, fuse_rmsnorm, rms_norm

__all__ = [
    "FusedRMSNorm",
    "Int4KernelConfig",
    "candidate_configs",
    "check_squares_dtype",
    "compose_epilogue",
    "decode_attention",
    "epilogue_max_m",
    "fuse_rmsnorm",
    "int4_matmul",
    "int4_mm",
    "int4_matmul_reference",
    "int4_silu_mul",
    "silu_mul_halves",
    "kernel_calls",
    "logit_stats",
    "norm_factor",
    "norm_stream_width",
    "refresh_choice",
    "row_squares",
    "register_weight",
    "rms_norm",
    "select_config",
    "split_rule",
    "squares_width",
    "tune",
    "tune_model",
]
