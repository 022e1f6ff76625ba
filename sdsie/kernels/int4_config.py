"""Which launch configuration an INT4 call runs: `Int4KernelConfig`, and `select_config`'s sources in the order it
asks them.

1. The local tuned cache (`tuned_cache_path`), written ahead of time by `sdsie tune-int4` (`sdsie.kernels.int4_tune`):
   this GPU model's measured best among the candidates below, per shape and M bucket.
2. The shipped tuned table (`tuned_configs.json`, or `$SDSIE_TUNED_CONFIGS`): per GPU name, the best of the choice's
   own candidates (the mma GEMV's included) that a graphed sweep measured for each fitted shape and M bucket.
3. On sm_90+, for bf16 x at M <= 16, the fragment-order tensor-core GEMV (`mma_config`) where its rule takes the shape.
4. The rule (`rule_config`): the candidate of least fitted cost from the shape's arithmetic (bytes the busiest SM
   reads, K tiles in the longest chain), for any shape on any GPU.

Measured before modelled: a shape the table holds runs its sweep's best; 3 and 4 serve every other shape.
`candidate_configs` lists every CUDA-core configuration 2-4 can return; every one of them passes the kernel's property
tests (the mma configurations, `MMA_CONFIGS`, have tests/test_int4_mma.py). The launcher (`sdsie.kernels.int4_gemm`)
asks once per (weight, M, x layout) and keeps the answer in a launch plan.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from sdsie.kernels.device import DEFAULT_SMS, sm_count

__all__ = ["Int4KernelConfig", "MMA_BLOCK_CONFIGS", "MMA_CONFIGS", "TUNED_M", "candidate_configs", "device_name",
           "mma_blocks", "mma_config", "mma_stages", "parse_shape", "read_tuned_cache", "rule_config", "select_config",
           "select_config_with_source", "tuned_cache_path", "tuned_key", "tuned_lookup", "tuned_path"]


GEMV_ROWS = (1, 2, 4)  # rows per GEMV program (the kernel's ROWS)


MMA_BLOCK_N = (16, 32, 64)  # an mma configuration's rows a program: 1, 2 or 4 blocks of 16
MMA_STAGES = (2, 3, 4)  # an mma configuration's num_stages: pairs of chunks (128 codes) in flight a warp


@dataclass(frozen=True)
class Int4KernelConfig:
    """Launch configuration. block_m in GEMV_ROWS selects the GEMV kernel with that many rows per program (each
    weight tile loaded and its codes extracted once for them; 1 suits M == 1, 2 and 4 small M), block_m >= 16
    the tl.dot kernel."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2  # GEMV: <= 2 prefetches the next weight tile in registers; >= 3 pipelines through cp.async
    # GEMV: x as one contiguous tile split in registers, else eight gathers. planes (swap_ab): x's pairs as int32
    # words through cp.async where x allows it, else two strided gathers (loaded in each K tile, not staged)
    x_tile: bool = True
    swap_ab: bool = False  # tl.dot only: dequantized weights as the wgmma's left operand (_int4_gemm_planes_kernel)
    # ptxas's cap on registers per thread (Triton's maxnreg; None: its own choice). The M = 1 GEMV is latency-bound
    # for lack of warps, and its 160 registers a thread allow 12 warps an SM (docs/kernel-log.md); a cap trades
    # spills for warps. The mma GEMV takes one too (96 registers uncapped at M <= 8: 5 programs of 4 warps an SM;
    # 80: 6).
    # Ignored by the interpreter.
    max_registers: int | None = None
    # the fragment-order tensor-core GEMV (`sdsie.kernels.int4_mma`): M <= 16, bf16 x, block_n / 16 row blocks of 16
    # rows a program (sharing x's registers), num_warps warps along K, each with num_stages pairs of 128 codes in
    # flight; block_m 8 and block_k 128 name that tile
    mma: bool = False

    def __post_init__(self) -> None:
        if self.max_registers is not None and (not isinstance(self.max_registers, int)
                                               or not 24 <= self.max_registers <= 255 or self.max_registers % 8):
            raise ValueError(f"Int4KernelConfig.max_registers must be None or a multiple of 8 in [24, 255], got "
                             f"{self.max_registers!r}")
        if self.mma:
            if (self.block_m, self.block_k, self.split_k, self.swap_ab) != (8, 128, 1, False) or \
                    self.block_n not in MMA_BLOCK_N:
                raise ValueError(f"an mma configuration is block_m 8, block_n one of {MMA_BLOCK_N}, block_k 128, no "
                                 f"split, no swap_ab, got {self}")
            if self.num_warps not in (4, 8):
                raise ValueError(f"an mma configuration takes 4 or 8 warps, got {self.num_warps}")
            if self.num_stages not in MMA_STAGES:
                raise ValueError(f"an mma configuration keeps {MMA_STAGES} pairs in flight a warp (num_stages), got "
                                 f"{self.num_stages}")
            return
        for flag in ("x_tile", "swap_ab"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"Int4KernelConfig.{flag} must be a bool, got {getattr(self, flag)!r}")
        for name in ("block_m", "block_n", "block_k", "split_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Int4KernelConfig.{name} must be a positive power of two, got {v}")
        if self.block_k < 2:
            raise ValueError(f"Int4KernelConfig.block_k must be >= 2 (two codes per byte), got {self.block_k}")
        if self.block_m not in GEMV_ROWS and (self.block_m < 16 or self.block_k < 32 or self.block_n < 16):
            raise ValueError(f"block_m must be a GEMV row count {GEMV_ROWS} or a tl.dot tile (block_m >= 16, block_n "
                             f">= 16, block_k >= 32), got {self}")
        if self.swap_ab and self.block_m in GEMV_ROWS:
            raise ValueError(f"swap_ab is a tl.dot layout (block_m >= 16), got {self}")

    @property
    def gemv(self) -> bool:
        return self.block_m in GEMV_ROWS


# M up to this runs GEMV programs (tables; the rule at M = 1, and at M = 2 where they cost less), M in 3..16 the
# planes kernel
GEMV_MAX_M = 2

# the bytes tl.dot tile for M > 16: what the rule returns there, though `int4_matmul` runs it only when a call names
# it (more rows go 16 at a time through the small-M choice, or unpack the weight for one cuBLAS matmul)
_LARGE_M_CONFIG = Int4KernelConfig(64, 64, 64, split_k=1, num_warps=4)


def _k_tiling(cfg: Int4KernelConfig, k: int, group_size: int) -> tuple[int, int, int]:
    """(block_k, split_k, k_per_split) of a launch of `cfg` over K codes: a tl.dot tile never straddles two groups,
    and K splits stop at the power of two that leaves each split one tile."""
    block_k = cfg.block_k
    if not cfg.gemv and group_size < k:
        block_k = min(block_k, group_size)
    split_k = min(cfg.split_k, triton.next_power_of_2(triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return block_k, split_k, k_per_split


@dataclass(frozen=True)
class RuleTerm:
    """One candidate of the configuration rule with its fitted cost: per_kb microseconds per kilobyte the busiest SM
    reads, plus fixed_us (launch, K-split reduction, the pipeline's fill)."""

    config: Int4KernelConfig
    per_kb: float
    fixed_us: float


@dataclass(frozen=True)
class RuleFamily:
    """The rule's candidates for M up to max_m, and the constants their costs share (`rule_features`):
    spread, how many times its fair share of the bandwidth one SM can draw; programs_per_sm, how many programs an SM
    runs at once; per_tile_us, the time a program's chain of K tiles costs per tile."""

    max_m: int
    spread: float
    programs_per_sm: int
    per_tile_us: float
    terms: tuple[RuleTerm, ...]


def rule_features(cfg: Int4KernelConfig, m: int, n: int, k: int, group_size: int, sms: int, spread: float,
                  programs_per_sm: int) -> tuple[float, float]:
    """(kilobytes the busiest SM reads, K tiles in the longest chain) for `cfg` on this shape: the shape's arithmetic
    the rule's costs are linear in. Programs = N tiles x K splits x M tiles, dealt round robin over the SMs; a program
    reads whole tiles (a partial last tile costs a whole one); an SM draws at most `spread` times its fair share."""
    block_k, split_k, k_per_split = _k_tiling(cfg, k, group_size)
    programs = triton.cdiv(n, cfg.block_n) * split_k * triton.cdiv(m, cfg.block_m)
    per_program = cfg.block_n * k_per_split / 2
    busiest = max(n * k / 2 / sms, -(-programs // sms) * per_program / spread)
    chain = k_per_split // block_k * -(-programs // (sms * programs_per_sm))
    return busiest / 1024, float(chain)


def rule_cost(family: RuleFamily, term: RuleTerm, m: int, n: int, k: int, group_size: int, sms: int) -> float:
    """The fitted time in microseconds of `term`'s configuration on this shape."""
    kb, chain = rule_features(term.config, m, n, k, group_size, sms, family.spread, family.programs_per_sm)
    return term.per_kb * kb + family.per_tile_us * chain + term.fixed_us


def rule_choice(family: RuleFamily, m: int, n: int, k: int, group_size: int, sms: int) -> Int4KernelConfig:
    """The family's candidate of least fitted cost (the first listed on a tie)."""
    return min(family.terms, key=lambda t: rule_cost(family, t, m, n, k, group_size, sms)).config


# The rule: per kernel family, the H200 sweep's winners and their costs, fitted by
# reproductions/kernels/fit_config_rule.py on telemetry/raw/shape_sweep_m1_m16_h200.json (leave-one-model-family-out
# scores: docs/kernel-log.md, 2026-12-03). M <= 2: one-row GEMV programs (fitted at M = 1; a second row doubles the
# programs); M in 3..16: planes (fitted at M = 16; rows past M are masked).
RULE_FAMILIES: tuple[RuleFamily, ...] = (
    RuleFamily(2, 1.0, 2, 0.18959, (
        RuleTerm(Int4KernelConfig(1, 32, 1024, num_stages=3), 0.0404095, 2.67241),
        RuleTerm(Int4KernelConfig(1, 8, 2048, num_warps=8, num_stages=1), 0.0586749, 1.95658),
        RuleTerm(Int4KernelConfig(1, 64, 512, num_stages=3), 0.0381503, 2.62633),
        RuleTerm(Int4KernelConfig(1, 4, 4096, num_warps=8, num_stages=1), 0.0701188, 1.81633),
        RuleTerm(Int4KernelConfig(1, 128, 256, split_k=8), 0.0573233, 3.10384),
        RuleTerm(Int4KernelConfig(1, 128, 256, num_stages=3), 0.0363105, 2.6564),
    )),
    RuleFamily(16, 1.5, 2, 0.374556, (
        RuleTerm(Int4KernelConfig(16, 128, 128, split_k=4, num_stages=4, swap_ab=True), 0.0460965, 4.35678),
        RuleTerm(Int4KernelConfig(16, 64, 128, split_k=8, num_stages=3, swap_ab=True), 0.0373138, 4.23478),
        RuleTerm(Int4KernelConfig(16, 128, 128, num_stages=3, swap_ab=True), 0.0361715, 3.00689),
        RuleTerm(Int4KernelConfig(16, 128, 128, split_k=8, num_stages=4, swap_ab=True), 0.0612892, 4.7506),
        RuleTerm(Int4KernelConfig(16, 256, 128, split_k=4, num_stages=3, swap_ab=True), 0.061076, 5.00026),
        RuleTerm(Int4KernelConfig(16, 64, 128, split_k=8, num_stages=4, swap_ab=True), 0.0408614, 4.18003),
    )),
)


def rule_config(m: int, n: int, k: int, group_size: int, sms: int) -> Int4KernelConfig:
    """The configuration the rule picks for this shape on a GPU of `sms` SMs (any shape: no table needed).

    M = 1 takes the GEMV family, M in 3..16 the planes family. M = 2 takes whichever family's pick has the lower
    fitted cost: the GEMV for decoder linears, planes for LM heads with a short K, where one-row programs read the
    head twice (Qwen2.5-1.5B's and Gemma-2-2B's heads at M = 2: the GEMV 1.44-1.49x slower than planes,
    telemetry/raw/shape_fit_choice_sweep_m1_to_m16_h200.json, shape_heldout_choice_sweep_m2_to_m16_h200.json)."""
    if m < 1 or n < 1 or k < 1 or group_size < 1 or sms < 1:
        raise ValueError(f"rule_config: M, N, K, group_size and sms must be >= 1, got {(m, n, k, group_size, sms)}")
    families = [f for f in RULE_FAMILIES if m <= f.max_m]
    if not families:
        return _LARGE_M_CONFIG
    if m != GEMV_MAX_M:
        return rule_choice(families[0], m, n, k, group_size, sms)
    # (fitted cost, family, configuration) of every term; a tie goes to the GEMV family, then to the first listed
    scored = ((rule_cost(f, t, m, n, k, group_size, sms), i, t.config) for i, f in enumerate(families) for t in f.terms)
    return min(scored, key=lambda c: c[:2])[2]


SHIPPED_TUNED_PATH = Path(__file__).with_name("tuned_configs.json")
TUNED_ENV = "SDSIE_TUNED_CONFIGS"  # a table to use instead of the shipped one (a sweep output, not yet committed)


def tuned_path() -> Path:
    """The tuned table in use: $SDSIE_TUNED_CONFIGS if set (it must exist), else the one shipped with the package."""
    override = os.environ.get(TUNED_ENV)
    if not override:
        return SHIPPED_TUNED_PATH
    path = Path(override)
    if not path.is_file():
        raise FileNotFoundError(f"{TUNED_ENV}={override!r} is not a file (a tuned_configs.json written by a sweep)")
    return path


@functools.cache
def _tuned_table() -> dict[str, dict[str, Int4KernelConfig]]:
    """Per-GPU, per-shape configurations measured by `reproductions/kernels/int4_bench.py --sweep` (tuned_path()).

    {device name: {"m1|N|K|group": config, "m16|N|K|group": config}}; group is "pc" per channel.
    """
    path = tuned_path()
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    return {dev: {key: Int4KernelConfig(**cfg) for key, cfg in table.items()} for dev, table in raw.items()}


# The local cache `sdsie tune-int4` writes (`sdsie.kernels.int4_tune`): per GPU model, the fastest of the choice's own
# candidates for each shape and M bucket, timed on this machine. It comes first in `select_config`: it is a
# measurement on the user's GPU of every configuration the other sources could return. "off" reads none.
TUNED_CACHE_ENV = "SDSIE_INT4_CACHE"
TUNED_CACHE_FORMAT = "sdsie-int4-tuned-v1"


def tuned_cache_path() -> Path | None:
    """The local tuned cache: $SDSIE_INT4_CACHE ("off": none), else `$SDSIE_CACHE/int4_tuned.json` (default
    `~/.cache/sdsie/int4_tuned.json`). It need not exist."""
    override = os.environ.get(TUNED_CACHE_ENV)
    if override is not None and override.strip().lower() == "off":
        return None
    if override:
        return Path(override).expanduser()
    base = os.environ.get("SDSIE_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "sdsie") / "int4_tuned.json"


def read_tuned_cache(path: Path) -> dict:
    """The cache file's document ({"format", "devices": {device name: {"configs": {key: config fields}, ...}}}),
    or an empty one where the file does not exist. A file of another shape is an error naming it."""
    if not path.exists():
        return {"format": TUNED_CACHE_FORMAT, "devices": {}}
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"the INT4 tuned cache {path} is not JSON ({err}); delete it or point {TUNED_CACHE_ENV} "
                         f"elsewhere") from None
    if not isinstance(doc, dict) or doc.get("format") != TUNED_CACHE_FORMAT or not isinstance(doc.get("devices"), dict):
        raise ValueError(f"the INT4 tuned cache {path} is not a {TUNED_CACHE_FORMAT} document (written by sdsie "
                         f"tune-int4); delete it or point {TUNED_CACHE_ENV} elsewhere")
    return doc


@functools.cache
def _local_table() -> dict[str, dict[str, Int4KernelConfig]]:
    """{device name: {tuned key: config}} from the local tuned cache (empty when there is none)."""
    path = tuned_cache_path()
    if path is None:
        return {}
    devices = read_tuned_cache(path)["devices"]
    try:
        return {dev: {key: Int4KernelConfig(**cfg) for key, cfg in entry["configs"].items()}
                for dev, entry in devices.items()}
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"the INT4 tuned cache {path} holds an entry that is not a configuration ({err}); delete "
                         f"it or point {TUNED_CACHE_ENV} elsewhere") from None


def device_name(device: torch.device) -> str:
    """The name tuned tables key a device by: the CUDA device's name, or "cpu" (the Triton interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device.index if device.index is not None else torch.cuda.current_device())
    return device.type


TUNED_M = (1, 2, 4, 8, 16)  # M buckets the sweep tunes; M in (2, 4] uses the m4 entry, and so on


def parse_shape(text: str) -> tuple[int, int]:
    """(N, K) of a linear's shape written NxK (out x in features, e.g. 4096x14336): the one parser of shapes that
    the CLI and the benches share. ValueError naming the text for anything else."""
    n, sep, k = text.strip().lower().partition("x")
    if not (sep and n.isdigit() and k.isdigit()):
        raise ValueError(f"a shape is NxK (out x in features), e.g. 4096x4096; got {text!r}")
    if int(n) < 1 or int(k) < 1:
        raise ValueError(f"a shape's N and K are >= 1, got {text!r}")
    return int(n), int(k)


def tuned_key(m: int, n: int, k: int, group_size: int) -> str:
    if not 1 <= m <= TUNED_M[-1]:
        raise ValueError(f"tuned_key: M={m} is outside the tuned buckets 1..{TUNED_M[-1]}")
    bucket = next(b for b in TUNED_M if m <= b)
    return f"m{bucket}|{n}|{k}|{'pc' if group_size >= k else group_size}"


def tuned_lookup(
    table: dict[str, Int4KernelConfig], m: int, n: int, k: int, group_size: int, lend: bool = True
) -> Int4KernelConfig | None:
    """M's own bucket for this shape, else (`lend`) the nearest larger bucket of the same kernel family (GEMV rows:
    M <= 2; planes: M in 3..16) the sweep tuned for it, else None.

    A configuration tuned for more rows is correct for fewer. On the H200, M = 8, which no sweep had tuned,
    ran the heuristic GEMM at 0.43-0.83x of bf16; on 14336x4096 it took 74.4 us where the tuned M = 16
    configuration took 48.4 us with twice the rows (records ca1fd3d4 and 22f3a099 agree within 1%). An M = 2 call
    does not borrow an M = 4-16 planes entry: the rule's GEMV serves it (docs/kernel-log.md, 2026-12-03). The choice
    lends only where the mma GEMV's rule declines: a table leaves out the cases whose sweep never timed that rule's
    pick (`best_table`), and the M = 16 entry lent to M = 4 can be a planes tile 1.6x slower than the mma GEMV there
    (docs/kernel-log.md, 2026-12-05 18:10).
    """
    key = tuned_key(m, n, k, group_size)
    bucket = int(key.split("|", 1)[0][1:])
    limit = (GEMV_MAX_M if bucket <= GEMV_MAX_M else TUNED_M[-1]) if lend else bucket
    for b in (b for b in TUNED_M if bucket <= b <= limit):
        cfg = table.get(f"m{b}|{key.split('|', 1)[1]}")
        if cfg is not None:
            return cfg
    return None


def candidate_configs() -> tuple[Int4KernelConfig, ...]:
    """Every configuration of the rule and the tuned tables that `select_config` can pick, each once. (The mma
    configurations, `MMA_CONFIGS`, take only shapes their kernel tiles: tests/test_int4_mma.py covers them.)"""
    base = tuple(t.config for f in RULE_FAMILIES for t in f.terms) + (_LARGE_M_CONFIG,)
    tuned = {cfg for table in _tuned_table().values() for cfg in table.values() if not cfg.mma}
    base = tuple(dict.fromkeys(base))
    return base + tuple(sorted(tuned - set(base), key=lambda c: dataclasses.astuple(c)))


def select_config(m: int, n: int, k: int, device: torch.device, group_size: int | None = None,
                  allow_mma: bool = True) -> Int4KernelConfig:
    """The local tuned cache's entry for this GPU model, shape and M bucket if `sdsie tune-int4` wrote one (M <= 16);
    else the shipped tuned configuration for this GPU and shape if one was measured (M <= 16); else on sm_90+ the
    tensor-core GEMV where `mma_config` takes the shape (for bf16 x); else the rule's (`rule_config`: the candidate
    of least fitted cost from the shape's arithmetic). An mma entry of either table serves bf16 x on sm_90+ only.
    Memoized: it runs on every call, and host time before the launch is latency at batch 1 (`refresh_choice`
    forgets it)."""
    return select_config_with_source(m, n, k, device, group_size, allow_mma)[0]


def select_config_with_source(m: int, n: int, k: int, device: torch.device, group_size: int | None = None,
                              allow_mma: bool = True) -> tuple[Int4KernelConfig, str]:
    """`select_config`'s choice and where it came from: "tuned" (this GPU model's entry in the local tuned cache,
    `sdsie tune-int4`), "table" (the shipped table's entry for this GPU), "mma" (the tensor-core GEMV's rule, taken
    by bf16 x; `allow_mma` False for other x) or "rule"."""
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    return _select_config(m, n, k, device.type, index, group_size if group_size is not None else k, allow_mma)


# M <= 16 on sm_90+, bf16 x, a shape the shipped table does not hold: the fragment-order tensor-core GEMV
# (`sdsie.kernels.int4_mma`). Fitted on graphed sweeps of every candidate over 59 decoder shapes of 11 models at M = 1-8
# (telemetry/raw/shape_fit_choice_sweep_m1_to_m16_h200.json, shape_heldout_choice_sweep_*_h200.json; docs/kernel-log.md,
# 2026-12-05 04:45). It declines where the CUDA-core kernels were faster:
# - too few programs at M <= 2. It runs N / 16 programs; at M = 1 fewer than half the SMs' count (N = 1024 on an
#   H200: 64 programs) ran up to 1.15x slower than the CUDA-core GEMV's 4-row programs with K whole (Llama-3.1-8B
#   k/v), and at M = 2 fewer than a quarter (N = 512: 32) up to 1.30x slower (Qwen2.5-7B k/v). From 3 rows it wins at
#   every N.
# - LM heads (N >= MMA_MAX_N) with K < MMA_LM_HEAD_MIN_K: its warps get too few k16 pairs each. Gemma-2-2B's head
#   (K = 2304) at M = 1: 119.0 against the GEMV's 98.8 us; Qwen2.5-1.5B's (K = 1536): 54.6 against 40.7.
# M = 9-16 (a second mma on the same A registers, 128 registers a thread on sm_90: 4 programs of 4 warps an SM) takes
# it where its N / 16 programs fit in one wave at 4 an SM, else the planes kernel: on an H100, graphed sweeps of both
# with every candidate (telemetry/raw/shape_fit_choice_sweep_m1_to_m16_h100.json, shape_heldout2_choice_sweep_*_h100
# .json) put the mma GEMV ahead at M = 16 on 12 of the 17 one-wave fitted shapes (the rest within a few percent) and
# behind on 12 of the 13 larger ones (Qwen2.5-7B gate/up: 29.9 against 26.4 us); with this rule 28 of 30 fitted and 38
# of 42 held-out cases (group 128) run within 90% of the sweep's best, with the planes rule alone 18 and 26
# (docs/kernel-log.md, 2026-12-05 15:40). Its warps split K at M <= 8: 8 where K >= 2N, K >= 4096 and the 8-warp
# programs all fit on the SMs at two a SM (N / 16 <= 2 x SMs), else 4. Where the programs overflow (N = 5120 downs:
# 320 > 264), or K < 4096 (1024-row k/v at K = 2304-3072), 8 warps lost 15-29% to 4.
MMA_MAX_N = 65536
MMA_ONE_WAVE = 4  # programs an SM at M = 9-16 (128 registers a thread, 4 warps)
MMA_LM_HEAD_MIN_K = 3072
MMA_CONFIGS = {w: Int4KernelConfig(8, 16, 128, num_warps=w, mma=True) for w in (4, 8)}
# Several row blocks a program: each warp's x registers serve them all, so x's bytes read per weight byte fall from
# M / 4 (one block, 16 rows: 4 at M = 16) by the block count; fewer programs, more registers a thread (sm_90: 96,
# 128 and 255 at 1, 2 and 4 blocks, M <= 8; 128 and 178 at 1 and 2 blocks, M = 9-16, where 4 blocks spill). Not
# among the choice's candidates: on an H100 they were the fastest in 10 of 468 swept cases, by at most 4%, and a
# median 1.20x slower than one block (docs/kernel-log.md, 2026-12-05 15:40). A configuration can name them.
MMA_BLOCK_CONFIGS = {(w, bn // 16): Int4KernelConfig(8, bn, 128, num_warps=w, mma=True)
                     for w in (4, 8) for bn in MMA_BLOCK_N[1:]}


def mma_blocks(warps: int, blocks: int = 1, stages: int = 2) -> Int4KernelConfig:
    """The mma configuration of `warps` warps, `blocks` row blocks (of 16 rows) a program and `stages` pairs of
    chunks in flight a warp."""
    if warps not in MMA_CONFIGS or (blocks != 1 and (warps, blocks) not in MMA_BLOCK_CONFIGS):
        raise ValueError(f"no mma configuration of {warps} warps and {blocks} row blocks a program; there are "
                         f"{sorted(MMA_CONFIGS)} warps and {[bn // 16 for bn in MMA_BLOCK_N]} blocks")
    cfg = MMA_CONFIGS[warps] if blocks == 1 else MMA_BLOCK_CONFIGS[warps, blocks]
    return cfg if stages == cfg.num_stages else dataclasses.replace(cfg, num_stages=stages)


# 4 pairs in flight a warp (166 registers a thread at M <= 8: 3 programs of 4 warps an SM, against 5 at 2 pairs) where
# the N / 16 programs number 2-3 an SM: the cap of 3 spreads them evenly over the SMs and each warp keeps twice the
# bytes in flight. On an H100 (telemetry/raw/mma_stages_probe_h100.json, mma_stages4_probe_m1_m4_h100.json), at
# M = 1 and 4: Llama-3.1-8B fused q/k/v (6144x4096, 2.9 programs an SM) 8.34 -> 6.27 us and 8.88 -> 6.82, Qwen2.5-7B
# fused q/k/v (4608x3584, 2.2) 6.49 -> 5.70 and 6.88 -> 6.43, 5120x3072 5.77 -> 5.37 and 6.09 -> 5.89, 5120x5120
# unchanged; at 2 or fewer programs an SM (4096x4096, 3584x3584) and past 3 (14336x4096) 2-13% slower
# (docs/kernel-log.md, 2026-12-05 18:10). Not at M = 9-16, where 4 pairs take 254 registers (2 programs an SM).
MMA_SPREAD_STAGES = 4


def mma_stages(m: int, n: int, warps: int, sms: int = DEFAULT_SMS) -> int:
    """Pairs in flight a warp for the mma GEMV's one-block programs: MMA_SPREAD_STAGES where M <= 8, 4 warps and
    2 x SMs < N / 16 <= 3 x SMs, else 2."""
    return MMA_SPREAD_STAGES if m <= 8 and warps == 4 and 2 * sms < n // 16 <= 3 * sms else 2


# At M = 1 the mma GEMV where its N / 16 programs number at least this many an SM, by GPU name; below, the CUDA-core
# GEMV's rule pick is faster. H200 (the default): the mma GEMV is faster from N / 16 = 96 up (0.76-0.96 of the
# CUDA-core GEMV's best time, telemetry/raw/shape_*_choice_sweep_*_h200.json), so half the SMs. H100: the rule's
# CUDA-core pick is faster at N / 16 = 96-192 in 9 of 10 cases, by 1.05-1.18x (the tenth 1.4% slower), and the mma
# GEMV from 224 (shape_fit_choice_sweep_m1_to_m16_h100.json, int4_tune_heldout_h100.json; docs/kernel-log.md
# 2026-12-07 11:40).
MMA_M1_PROGRAMS_AN_SM = {"NVIDIA H100 80GB HBM3": 1.5}
MMA_M1_PROGRAMS_AN_SM_DEFAULT = 0.5


def mma_m1_programs_an_sm(device: str) -> float:
    """`mma_config`'s M = 1 threshold for the GPU of this name (`MMA_M1_PROGRAMS_AN_SM`, else the default)."""
    return MMA_M1_PROGRAMS_AN_SM.get(device, MMA_M1_PROGRAMS_AN_SM_DEFAULT)


def mma_config(m: int, n: int, k: int, group_size: int, sms: int = DEFAULT_SMS,
               m1_programs_an_sm: float = MMA_M1_PROGRAMS_AN_SM_DEFAULT) -> Int4KernelConfig | None:
    """The mma configuration for a bf16 call of this shape on an sm_90+ GPU of `sms` SMs, or None where the kernel
    does not apply (shape or group) or its rule says the CUDA-core kernels are faster (at M = 1: fewer than
    `m1_programs_an_sm` programs an SM, the GPU's `MMA_M1_PROGRAMS_AN_SM`)."""
    shape_ok = n % 16 == 0 and k % 128 == 0 and (group_size >= k or group_size % 128 == 0)
    if not (1 <= m <= 16 and shape_ok) or (n >= MMA_MAX_N and k < MMA_LM_HEAD_MIN_K):
        return None
    programs = n // 16
    if m > 8:
        return MMA_CONFIGS[4] if programs <= MMA_ONE_WAVE * sms else None
    if (m == 1 and programs < m1_programs_an_sm * sms) or (m == 2 and 4 * programs < sms):
        return None
    warps = 8 if k >= 2 * n and k >= 4096 and programs <= 2 * sms else 4
    return mma_blocks(warps, 1, mma_stages(m, n, warps, sms))


@functools.lru_cache(maxsize=4096)
def _select_config(m: int, n: int, k: int, device_type: str, index: int, group_size: int,
                   allow_mma: bool = True) -> tuple[Int4KernelConfig, str]:
    local = _local_table()
    if local and m <= TUNED_M[-1]:
        cfg = local.get(device_name(torch.device(device_type, index)), {}).get(tuned_key(m, n, k, group_size))
        if cfg is not None and (allow_mma or not cfg.mma):
            return cfg, "tuned"
    mma_ok = allow_mma and device_type == "cuda" and torch.cuda.get_device_capability(index)[0] >= 9
    sms = sm_count(torch.device(device_type, index))
    name = torch.cuda.get_device_name(index) if device_type == "cuda" else ""
    mma = mma_config(m, n, k, group_size, sms, mma_m1_programs_an_sm(name)) if mma_ok else None
    if device_type == "cuda" and m <= TUNED_M[-1]:
        cfg = tuned_lookup(_tuned_table().get(name, {}), m, n, k, group_size, lend=mma is None)
        if cfg is not None and (mma_ok or not cfg.mma):
            return cfg, "table"
    if mma is not None:
        return mma, "mma"
    return rule_config(m, n, k, min(group_size, k), sms), "rule"
