"""Compile the GEMV kernel for sm_90 on any host (no GPU needed) and count what its PTX does.

    python -m reproductions.kernels.inspect_ptx

Integer arguments get the divisibility-by-16 attribute Triton gives them at run time for the
Llama shapes (N, K, strides multiples of 16), so vectorization matches a real launch.
Reports 128-bit global loads, local-memory (spill) accesses, conversions and shared memory.
"""

from __future__ import annotations

import re

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from sdsie.kernels.int4_gemm import _int4_gemv_kernel, candidate_configs

NAMES = ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "ws_ptr", "lock_ptr", "M", "N", "K", "NCOLS", "G",
         "k_per_split", "stride_xm", "stride_xk", "stride_qn", "stride_ym"]
TYPES = ["*bf16", "*i32", "*bf16", "*bf16", "*bf16", "*fp32", "*i32"] + ["i32"] * 10
DIV16 = {"x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "ws_ptr", "lock_ptr", "N", "K", "NCOLS", "k_per_split",
         "stride_xm", "stride_qn", "stride_ym"}


def inspect(block_n: int, block_k: int, split_k: int, num_warps: int, group: int = 128) -> dict[str, int]:
    consts = {"GROUP": group, "PER_CHANNEL": False, "HAS_ZEROS": True, "BLOCK_N": block_n, "BLOCK_K": block_k,
              "SPLIT_K": split_k, "PER_COL": 8}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(NAMES) if n in DIV16}
    sig = {**dict(zip(NAMES, TYPES, strict=True)), **{k: "constexpr" for k in consts}}
    kernel = compile(ASTSource(_int4_gemv_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": num_warps})
    ptx = kernel.asm["ptx"]
    return {
        "ld_global": len(re.findall(r"ld\.global", ptx)),
        "ld_global_v4": len(re.findall(r"ld\.global[^\n]*\.v4", ptx)),
        "local_mem": len(re.findall(r"(?:ld|st)\.local", ptx)),
        "cvt_to_f32": len(re.findall(r"cvt\.rn\.f32\.[us]", ptx)),
        "shared_bytes": kernel.metadata.shared,
    }


def main() -> int:
    print("| config | ld.global | of which 128-bit | local (spills) | int->f32 cvt | shared B |")
    print("|---|---|---|---|---|---|")
    for cfg in candidate_configs():
        if cfg.block_m != 1:
            continue
        r = inspect(cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps)
        print(f"| BN{cfg.block_n} BK{cfg.block_k} S{cfg.split_k} W{cfg.num_warps} | {r['ld_global']} | "
              f"{r['ld_global_v4']} | {r['local_mem']} | {r['cvt_to_f32']} | {r['shared_bytes']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
