"""What the INT4 GEMV compiles to for sm_90, checked offline (Triton's bundled ptxas and nvdisasm; no GPU).

A loop-instruction budget is the GEMV's speed at batch 1 (docs/kernel-log.md): these tests pin
the code-generation decisions that the H200 measurements rest on, so a refactor that undoes one fails here
rather than on the next GPU run. The compile runs in a subprocess: the test session interprets kernels
(TRITON_INTERPRET=1), which has nothing to compile."""

from __future__ import annotations

import pytest

from reproductions.kernels import inspect_ptx


def compiled_offline(imports: str, expression: str, what: str):
    """The JSON value of `expression` evaluated after `imports`, compiled for sm_90 offline (`what` names the kernels
    in a failure)."""
    return inspect_ptx.compiled_offline(f"import json; {imports}; print(json.dumps({expression}))", what)


def inspect_in_subprocess(**kwargs) -> dict:
    return compiled_offline("from reproductions.kernels.inspect_ptx import inspect", f"inspect(**{kwargs!r})",
                            "the GEMV")


def test_each_code_costs_one_lop3_and_the_pipelined_loop_stays_lean():
    """The codes' float bit patterns arrive as run-time arguments: with them as compile-time constants ptxas split
    every and-or into two LOP3s (4.6 SASS instructions per code in the loop instead of 3.5)."""
    r = inspect_in_subprocess(block_n=128, block_k=256, split_k=1, num_warps=4, stages=4)  # H200 LM-head config
    assert r["sass_lop3_per_code"] == pytest.approx(1.0)
    assert r["sass_loop_per_code"] < 3.8
    assert r["local_mem"] == 0 and r["cvt_to_f32"] == 0  # no spills, no int->float conversions
    assert r["loop_cp_async"] > 0 and r["loop_bar"] <= 2  # stages >= 3: weight tiles through cp.async



def test_the_gemv_pays_its_scale_once_per_32_codes():
    """The run fold: one FMA chain over a thread's four words before the scale and zero-point terms, so the loop
    issues 34 FMAs per 32 codes (1.06 a code, 1.10 with the x offsets) where one chain per word issued 40 (1.30 in
    the SASS). Per channel there is no scale in the loop: one FFMA a code. The accumulators shrink with it: the
    LM-head configuration holds at most 170 registers a thread (168 before, with five times the accumulators)."""
    grouped = inspect_in_subprocess(block_n=128, block_k=256, split_k=1, num_warps=4, stages=4)
    per_channel = inspect_in_subprocess(block_n=128, block_k=256, split_k=1, num_warps=4, stages=4, per_channel=True)
    assert grouped["sass_ffma_per_code"] < 1.15
    assert per_channel["sass_ffma_per_code"] < grouped["sass_ffma_per_code"]
    assert 0 < grouped["registers"] <= 170

def test_pipeline_stages_decide_how_weight_tiles_arrive():
    """num_stages acts in the compiled loop: 2 keeps the hand-written register prefetch (plain vector loads, no
    cp.async), 3 hands the loads to Triton's pipeliner (cp.async into shared memory)."""
    by_hand = inspect_in_subprocess(block_n=128, block_k=256, split_k=1, num_warps=4, stages=2)
    piped = inspect_in_subprocess(block_n=128, block_k=256, split_k=1, num_warps=4, stages=3)
    assert by_hand["loop_cp_async"] == 0 and by_hand["shared_bytes"] < 4096
    assert piped["loop_cp_async"] > 0 and piped["shared_bytes"] > 16384


def test_swap_ab_dequantizes_the_weight_tile_in_the_wgmmas_registers_with_fewer_instructions_per_code():
    """At M <= 16 the planes kernel's weight tile is the left operand of a Hopper wgmma, which takes it from registers.
    Its two nibble planes are elementwise functions of one loaded byte tile, so the register layout reaches back to
    the shared-memory load and no dequantized tile is stored (a words kernel, whose one loaded word fed several
    dots, stored one per dot: the hoist check's two). The inline PTX dequantizes two bytes per call; the loop
    costs fewer instructions per code than the bytes tl.dot kernel's (offline at BN 256: 2.6 against 6.4)."""
    hoist, r = compiled_offline("from reproductions.kernels.gemm_sass_probe import probe, hoist_check",
                                "[hoist_check(), probe(16, 256, 128, 4, ('package bytes', 'package planes', "
                                "'package planes, Triton ops', 'package planes, x gathers'))]", "the tl.dot kernels")
    assert hoist == {"1": 0, "2": 2}  # one int32 tile for one wgmma: no round trip; for two: one per dot
    planes, bytes_ = r["package planes"], r["package bytes"]
    assert planes["left_operand_in_registers"] and planes["hgmma"] > 0
    assert not bytes_["left_operand_in_registers"]
    assert planes["weight_tiles_through_shared"] == 0
    assert planes["sass_per_code"] < 3.5 < bytes_["sass_per_code"]
    ops = r["package planes, Triton ops"]  # ASM off, as the interpreter runs it: the PTX is what saves the repacking
    assert ops["weight_tiles_through_shared"] == 0 and ops["sass_per_code"] > planes["sass_per_code"] + 1.0
    assert 64 <= planes["registers"] <= 255  # cuobjdump's count: BN 256 with 4 warps uses the whole register file
    # X_WORDS acts: x's pairs as words join the weights in cp.async (no global load left in the loop); the two
    # strided gathers load synchronously in every tile and store x to shared memory there (docs/kernel-log.md)
    gathers = r["package planes, x gathers"]
    assert planes["ldg"] == 0 < gathers["ldg"]
    assert planes["ldgsts"] > gathers["ldgsts"] and planes["sts"] < gathers["sts"]
    assert planes["sass_per_code"] < gathers["sass_per_code"]


def test_scales_as_words_join_the_weights_in_cp_async_on_a_bn64_planes_tile():
    """SZ_WORDS acts in the compiled loop (sm_90, BN 64, 4 warps): read as int32 words (the scales a word per row,
    the zero-points two rows a word), they are staged through cp.async with the weights and no global load is left
    in the loop; as 2-byte values a thread's share is under the 4 bytes cp.async takes, so they are loaded
    synchronously in every tile (under ncu the down_proj BN 64 tile's hottest wait). The words add no
    barrier (pairs for the scales too add two: docs/kernel-log.md). The left operand stays in registers either way."""
    r = compiled_offline("from reproductions.kernels.gemm_sass_probe import probe",
                         "probe(16, 64, 128, 4, ('package planes', 'package planes, 2-byte scales'))",
                         "the planes kernel")
    pairs, halves = r["package planes"], r["package planes, 2-byte scales"]
    assert pairs["ldg"] == 0 < halves["ldg"]
    assert pairs["ldgsts"] > halves["ldgsts"]
    assert pairs["bar"] == halves["bar"]
    assert pairs["left_operand_in_registers"] and halves["left_operand_in_registers"]
    assert pairs["weight_tiles_through_shared"] == 0 == halves["weight_tiles_through_shared"]


def _waits_first(order: list[str], before: int) -> None:
    """One wait (ACQBULK) and, right after it, one release (PREEXIT); before the wait nothing but `before` 16-byte
    weight loads: x, the scales, the split-K workspace, its semaphores and y are touched after it."""
    assert order.count("ACQBULK") == 1 and order.count("PREEXIT") == 1, order
    wait = order.index("ACQBULK")
    assert order[wait + 1] == "PREEXIT", order
    assert len(order[:wait]) == before and all(op.startswith("LDG.E") and op.endswith(".128")
                                               for op in order[:wait]), order


@pytest.mark.parametrize(("stages", "split_k"), [(2, 4), (4, 1)])
def test_a_programmatic_gemv_touches_only_its_weights_before_the_wait(stages, split_k):
    """Launched as a programmatic dependent (PDL), the Triton GEMV may start while the kernel before it ends: with
    the register prefetch (2 stages) it asks for its first weight tile (8 loads of 16 bytes a thread at BN 128, BK
    256, 4 warps) before the wait; the pipelined loop (cp.async, 4 stages) waits first, since its prologue copies x's
    tiles with the weights'. Split K's workspace, semaphores and atomics come after the wait too. Without PDL
    neither instruction is there, and the loop is the same."""
    r = inspect_in_subprocess(block_n=128, block_k=256, split_k=split_k, num_warps=4, stages=stages, pdl=True)
    _waits_first(r["memory_order"], 8 if stages == 2 else 0)
    plain = inspect_in_subprocess(block_n=128, block_k=256, split_k=split_k, num_warps=4, stages=stages)
    assert not set(plain["memory_order"]) & {"ACQBULK", "PREEXIT"}, plain["memory_order"]
    assert r["sass_loop_per_code"] == pytest.approx(plain["sass_loop_per_code"])


def test_programmatic_planes_and_bytes_kernels_wait_before_any_global_access():
    """The planes and bytes tl.dot kernels (split K 4, BN 128, 4 warps), launched as programmatic dependents, wait
    before their first global access and release right after: their pipelined prologue copies x with the weights."""
    pdl, plain = compiled_offline("from reproductions.kernels.gemm_sass_probe import probe",
                                  "[probe(16, 128, 128, 4, ('package bytes', 'package planes'), pdl=p) "
                                  "for p in (True, False)]", "the tl.dot kernels")
    for name in ("package bytes", "package planes"):
        _waits_first(pdl[name]["memory_order"], 0)
        assert not set(plain[name]["memory_order"]) & {"ACQBULK", "PREEXIT"}, name
        assert pdl[name]["sass_per_code"] == pytest.approx(plain[name]["sass_per_code"]), name
