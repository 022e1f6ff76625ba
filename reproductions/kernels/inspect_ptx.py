"""Compile the GEMV kernel for sm_90 on any host (no GPU needed) and count what its PTX and SASS do.

    python -m reproductions.kernels.inspect_ptx [--configs BNxBKxW ...]

Integer arguments get the divisibility-by-16 attribute Triton gives them at run time for the
Llama shapes (N, K, strides multiples of 16), so vectorization matches a real launch; EVEN (no
masks) is set as it is for those shapes. Reports the main loop's PTX instructions per INT4 code a
thread handles (the issue-rate budget: at 4.2 TB/s an H200 SM must retire ~30 codes per clock, i.e.
~4 lane-instructions per code), its global/shared loads, local-memory (spill) accesses and
int->float conversions; and the loop's SASS (ptxas and nvdisasm ship with Triton) per code, which is what
issues: PTX and-or pairs, for one, became one or two LOP3s depending on where the constants lived.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from sdsie.kernels.int4_config import candidate_configs
from sdsie.kernels.int4_triton import _int4_gemv_kernel

NAMES = ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "ws_ptr", "lock_ptr", "M", "N", "K", "NCOLS", "G",
         "k_per_split", "stride_xm", "stride_xk", "stride_qn", "stride_ym", "magic_lo",
         "magic_hi"]
TYPES = ["*bf16", "*i32", "*bf16", "*bf16", "*bf16", "*fp32", "*i32"] + ["i32"] * 12
DIV16 = {"x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "ws_ptr", "lock_ptr", "N", "K", "NCOLS", "k_per_split",
         "stride_xm", "stride_qn", "stride_ym", "magic_lo",
         "magic_hi"}


def longest_loop(lines: Sequence[str], label: str, branch: str) -> list[str]:
    """The longest span of `lines` between a label and a backward branch to it (the K loop). `label` and `branch`
    are regexes whose group 1 is the label's name, on its defining line and on a branch line."""
    labels: dict[str, int] = {}
    best = (0, -1)
    for i, line in enumerate(lines):
        m = re.match(label, line)
        if m:
            labels[m.group(1)] = i
        m = re.search(branch, line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    return list(lines[best[0]:best[1] + 1])


def loop_body(ptx: str) -> list[str]:
    """The PTX K loop."""
    return longest_loop(ptx.splitlines(), r"^\s*\$(\w+):", r"bra(?:\.uni)?\s+\$(\w+);")


@functools.lru_cache(maxsize=4)
def _disassembly(cubin: bytes) -> tuple[str, ...]:
    """nvdisasm's lines for the cubin (the nvdisasm Triton ships); kept for the last few cubins, as one inspection
    reads the same cubin's loop, opcodes and memory order."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return tuple(subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True,
                                    check=True).stdout.splitlines())


def _instructions(lines: Sequence[str]) -> list[str]:
    """The instructions (opcode and operands, predicate dropped) among disassembly lines."""
    body = []
    for line in lines:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", line)
        if m:
            body.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1)).strip())
    return body


def sass_loop(cubin: bytes) -> list[str]:
    """The K loop's SASS instructions (opcode and operands)."""
    return _instructions(longest_loop(_disassembly(cubin), r"^\s*(\.L_x_\d+):", r"\bBRA\b.*?(\.L_x_\d+)"))


def hmma_chain(sass: list[str]) -> int:
    """The longest chain of HMMAs in `sass` each accumulating the one before's result (its C operand is the earlier
    one's destination, not overwritten in between): the mmas a warp waits through one after another."""
    depth: dict[str, int] = {}
    longest = 0
    for ins in sass:
        mma = re.match(r"HMMA\S* (R\d+), R\d+, R\d+, (R\w+)", ins)
        if mma:
            depth[mma.group(1)] = 1 + depth.get(mma.group(2), 0)
            longest = max(longest, depth[mma.group(1)])
            continue
        written = re.match(r"\S+ (R\d+),", ins)
        if written:
            depth.pop(written.group(1), None)
    return longest


def sass_ops(cubin: bytes) -> list[str]:
    """Every SASS instruction's opcode of the kernel, in order."""
    return [ins.split()[0] for ins in _instructions(_disassembly(cubin))]


# SASS opcodes that touch global memory (loads, stores, cp.async copies, atomics and reductions, generic-space loads
# and stores, bulk and tensor copies), and the two grid-dependency instructions
_GLOBAL_MEMORY = ("LDG", "STG", "LDGSTS", "ATOM", "RED", "LD.", "ST.", "UBLKCP", "UTMALDG", "UTMASTG")
_GRID_DEPENDENCY = ("ACQBULK", "PREEXIT")


def global_memory_order(cubin: bytes) -> list[str]:
    """The kernel's global-memory instructions and grid-dependency instructions (ACQBULK: griddepcontrol.wait;
    PREEXIT: launch_dependents), in program order: what a programmatic dependent touches before its wait."""
    return [op for op in sass_ops(cubin)
            if op.startswith(_GLOBAL_MEMORY) and op != "LDGDEPBAR" or op in _GRID_DEPENDENCY]


def compiled_offline(code: str, what: str) -> Any:
    """The JSON value that Python `code` prints last, run in a subprocess without TRITON_INTERPRET, where Triton
    compiles for sm_90 with its bundled ptxas (no GPU): how a test run that interprets kernels reads what the
    compiler makes of them. RuntimeError naming `what`, with the subprocess's stderr, when it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"compiling {what} for sm_90 failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def registers(cubin: bytes) -> int:
    """Registers a thread of the kernel holds (cuobjdump -res-usage, shipped with Triton): what caps warps per SM."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = re.search(r"REG:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no register count:\n{text[-2000:]}")
    return int(found.group(1))


def opcounts(lines: list[str]) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for line in lines:
        line = re.sub(r"^@!?%p\d+\s+", "", line.strip())
        if line and not line.startswith(("//", "$", "{", "}", ".")):
            c[line.split()[0].rstrip(";")] += 1
    return c


def inspect(block_n: int, block_k: int, split_k: int, num_warps: int, group: int = 128,
            x_tile: bool = True, rows: int = 1, stages: int = 2, per_channel: bool = False,
            pdl: bool = False) -> dict[str, object]:
    """The Triton GEMV compiled for sm_90: its K loop's PTX and SASS per code, registers and spills, and the order of
    its global-memory and grid-dependency instructions (`global_memory_order`; `pdl`: compiled to launch as a
    programmatic dependent)."""
    consts = {"GROUP": 1 if per_channel else group, "PER_CHANNEL": per_channel, "HAS_ZEROS": True,
              "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "PER_COL": 8, "EVEN": True,
              "X_TILE": x_tile, "ROWS": rows, "STAGES": stages, "PDL": pdl}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(NAMES) if n in DIV16}
    sig = {**dict(zip(NAMES, TYPES, strict=True)), **{k: "constexpr" for k in consts}}
    kernel = compile(ASTSource(_int4_gemv_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": num_warps, "num_stages": stages, "launch_pdl": pdl})
    ptx = kernel.asm["ptx"]
    loop = opcounts(loop_body(ptx))
    codes_per_thread = block_n * block_k / (32 * num_warps)
    sass = sass_loop(kernel.asm["cubin"])
    loop_ops = collections.Counter(op.split()[0].split(".")[0] for op in sass)
    return {
        "sass_loop_per_code": len(sass) / codes_per_thread,
        "sass_lop3_per_code": loop_ops["LOP3"] / codes_per_thread,
        "sass_ffma_per_code": loop_ops["FFMA"] / codes_per_thread,
        "loop_per_code": sum(loop.values()) / codes_per_thread,
        "loop_per_code_row": sum(loop.values()) / codes_per_thread / rows,  # per code and row of x it serves
        "loop_ld_global": sum(v for k, v in loop.items() if k.startswith("ld.global")),
        "loop_ld_shared": sum(v for k, v in loop.items() if k.startswith("ld.shared")),
        "loop_shfl": sum(v for k, v in loop.items() if k.startswith("shfl")),
        "loop_bar": sum(v for k, v in loop.items() if k.startswith("bar.")),
        "loop_cp_async": sum(v for k, v in loop.items() if k.startswith("cp.async.c")),
        "codes_per_thread": codes_per_thread,
        "local_mem": len(re.findall(r"(?:ld|st)\.local", ptx)),
        "cvt_to_f32": len(re.findall(r"cvt\.rn\.f32\.[us]", ptx)),
        "shared_bytes": kernel.metadata.shared,
        "registers": registers(kernel.asm["cubin"]),
        "memory_order": global_memory_order(kernel.asm["cubin"]),
    }


def inspect_mma(per_channel: bool = False, has_zeros: bool = True, warps: int = 4,
                halves: int = 1, silu_mul: bool = False, pdl: bool = False,
                max_registers: int | None = None, blocks: int = 1, stages: int = 2, norm_rows: int = 0,
                residual: bool = False, k: int = 4096, out_gain: bool = False,
                norm_squares: bool = False) -> dict[str, object]:
    """The fragment-order tensor-core GEMV (`sdsie.kernels.int4_mma`) compiled for sm_90: its loop's SASS opcode
    counts (the loop covers `stages` pairs of chunks, 64 codes a thread each), registers and local-memory accesses,
    and the order of its 16-byte loads and grid-dependency instructions (ACQBULK: griddepcontrol.wait; PREEXIT:
    launch_dependents) through the kernel (`pdl`: compiled to launch as a programmatic dependent; `max_registers`:
    ptxas's cap, `Int4KernelConfig.max_registers`; `blocks`: 16-row blocks a program; `stages`: pairs in flight a
    warp; `norm_rows`: the RMS-norm epilogue's rows (a power of 2 <= 8), its pre-pass over rows of `k` values;
    `residual`: the residual epilogue; `out_gain`: the output's gained copy and partial sums of squares;
    `norm_squares`: the norm's pre-pass over its producer's partial sums of squares instead of h), and its spill
    instructions (STL/LDL) and barriers (BAR.SYNC) in all; in the loop, the longest chain of dependent HMMAs
    (`hmma_chain`) and the 16-byte loads issued before its last HMMA. The constexpr arguments are `mma_consts`' for
    M = 16 with two halves, else M = norm_rows (at least 1)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from sdsie.kernels.int4_mma import _int4_mma_gemv_kernel, mma_consts

    names = ["x_ptr", "pw_ptr", "s_ptr", "z_ptr", "y_ptr", "r_ptr", "h_ptr", "g_ptr", "sq_ptr", "M", "N", "K",
             "stride_xm", "stride_ym", "stride_rm", "stride_hm", "stride_sm", "eps"]
    types = ["*bf16", "*i32", "*bf16", "*bf16", "*bf16", "*bf16", "*bf16", "*bf16", "*bf16"] + ["i32"] * 8 + ["fp32"]
    weight = SimpleNamespace(in_features=k, group_size=k if per_channel else 128,  # the Int4Weight fields read
                             zeros=object() if has_zeros else None)
    consts = mma_consts(weight, warps, 16 if halves == 2 else max(norm_rows, 1), silu_mul, pdl, blocks, stages,
                        norm_rows > 0, residual, out_gain, norm_squares)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in ("M", "eps")}
    sig = {**dict(zip(names, types, strict=True)), **{k: "constexpr" for k in consts}}
    options = {"num_warps": warps, "launch_pdl": pdl, **({} if max_registers is None else {"maxnreg": max_registers})}
    kernel = compile(GluonASTSource(_int4_mma_gemv_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                     options=options)
    sass = sass_loop(kernel.asm["cubin"])
    ops = sass_ops(kernel.asm["cubin"])
    order = [op for op in ops if op in ("LDG.E.128", "ACQBULK", "PREEXIT")]
    mmas = [i for i, ins in enumerate(sass) if ins.startswith("HMMA")]
    if not mmas:
        raise RuntimeError(f"the mma GEMV's longest loop holds no HMMA ({len(sass)} instructions): not its K loop")
    return {"sass_ops": dict(collections.Counter(op.split()[0] for op in sass)),
            "sass_loop_per_code": len(sass) / (64 * stages), "load_order": order,
            "hmma_chain": hmma_chain(sass),
            "loop_loads_before_last_mma": sum(ins.startswith("LDG.E.128") for ins in sass[:mmas[-1]]),
            "memory_order": global_memory_order(kernel.asm["cubin"]),
            "spill_instructions": sum(op.startswith(("STL", "LDL")) for op in ops),
            "barriers": sum(op.startswith("BAR.SYNC") for op in ops),
            "local_mem": len(re.findall(r"(?:ld|st)\.local", kernel.asm["ptx"])),
            "registers": registers(kernel.asm["cubin"])}


def _parse(spec: str) -> tuple[int, int, int, int, bool, int, int]:
    """[rRr]BNxBKxWARPS[xSPLIT][pSTAGES][g]: a leading rRr sets R rows per program, pS the pipeline stages (>= 3:
    cp.async through shared memory), a trailing g the x-gather variant."""
    m = re.fullmatch(r"(?:r(\d+)r)?(\d+)x(\d+)x(\d+)(?:x(\d+))?(?:p(\d+))?(g?)", spec)
    if m is None:
        raise ValueError(f"config spec {spec!r} is not [rROWSr]BNxBKxWARPS[xSPLIT][pSTAGES][g], e.g. r2r128x256x4p3")
    rows, bn, bk, w, split, stages, gather = m.groups()
    return int(bn), int(bk), int(split or 1), int(w), not gather, int(rows or 1), int(stages or 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*",
                   help="[rROWSr]BNxBKxWARPS[xSPLIT][pSTAGES][g] to inspect instead of the shipped ones "
                        "(r2r128x256x4, 128x256x4p4)")
    p.add_argument("--per-channel", action="store_true", help="one scale per output channel instead of group 128")
    a = p.parse_args(argv)
    if a.configs:
        cfgs = [_parse(c) for c in a.configs]
    else:
        cfgs = [(c.block_n, c.block_k, c.split_k, c.num_warps, c.x_tile, c.block_m, c.num_stages)
                for c in candidate_configs() if c.gemv]
    print(f"{'per channel' if a.per_channel else 'group 128'}:")
    print("| config | x | rows | loop instr/code | per code and row | SASS/code | SASS LOP3/code | SASS FFMA/code "
          "| codes/thread | loop ld.global | loop ld.shared | loop bar | loop cp.async | loop shfl | local (spills) "
          "| int->f32 cvt | shared B | registers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for bn, bk, split, w, x_tile, rows, stages in cfgs:
        r = inspect(bn, bk, split, w, x_tile=x_tile, rows=rows, stages=stages, per_channel=a.per_channel)
        print(f"| BN{bn} BK{bk} S{split} W{w} P{stages} | {'tile' if x_tile else 'gather'} | {rows} | "
              f"{r['loop_per_code']:.2f} "
              f"| {r['loop_per_code_row']:.2f} | {r['sass_loop_per_code']:.2f} | {r['sass_lop3_per_code']:.2f} | "
              f"{r['sass_ffma_per_code']:.2f} | "
              f"{r['codes_per_thread']:.0f} | {r['loop_ld_global']} | "
              f"{r['loop_ld_shared']} | {r['loop_bar']} | {r['loop_cp_async']} | "
              f"{r['loop_shfl']} | {r['local_mem']} | {r['cvt_to_f32']} | "
              f"{r['shared_bytes']} | {r['registers']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
