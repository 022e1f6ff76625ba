"""Claims a CPU can re-measure, re-measured (not read back) on every CI run.

Each test measures, builds the run record the gate would read, and judges it with the gate's own
rule (`sdsie.claims.judge_record`) against reproductions/claims.toml. With SDSIE_RECORD_DIR set,
the records are also written there (e.g. `SDSIE_RECORD_DIR=telemetry pytest reproductions -m "not gpu"`)
so `sdsie report` shows them.
"""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path

import pytest
import torch

from sdsie.claims import ClaimResult, Registry, judge_record, load_registry
from sdsie.clutch import TUNED, ClutchConfig, EntropyClutch
from sdsie.entropy import entropy
from sdsie.int4_format import Int4Weight
from sdsie.telemetry.records import RunRecord, capture_environment, write_record

REGISTRY = Path(__file__).resolve().parent / "claims.toml"
CPU = f"CPU ({platform.machine()}, {platform.python_implementation()} {platform.python_version()})"

# Llama-3.1-8B linear layers, N x K (out x in), with how many of each one decoder layer holds.
LLAMA_LAYER = {"q_proj": (4096, 4096, 1), "k_proj": (1024, 4096, 1), "v_proj": (1024, 4096, 1),
               "o_proj": (4096, 4096, 1), "gate_proj": (14336, 4096, 1), "up_proj": (14336, 4096, 1),
               "down_proj": (4096, 14336, 1)}
LM_HEAD = (128256, 4096)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry(REGISTRY)


def judge(registry: Registry, claim_ids: list[str], *, suite: str, metrics: dict, samples: dict, config: dict,
          model: str, trials: int = 1) -> dict[str, ClaimResult]:
    """Build the record, optionally write it, and judge it for each claim with the gate's rule."""
    record = RunRecord(claim_ids=claim_ids, suite=suite, config=config, samples=samples, metrics=metrics,
                       environment=capture_environment(), conditions={"model": model, "hardware": CPU,
                                                                      "trials": trials})
    if os.environ.get("SDSIE_RECORD_DIR"):
        record.source = write_record(record, os.environ["SDSIE_RECORD_DIR"])
    return {cid: judge_record(registry.claims[cid], record, registry) for cid in claim_ids}


def assert_consistent(results: dict[str, ClaimResult]) -> None:
    """Each claim here is portable: its measurement must lie in the seed's own band, on this machine."""
    bad = [r.summary() for r in results.values() if not r.claim.portable or r.seed.verdict != "consistent"
           or r.failed]
    assert not bad, "\n".join(bad)


# -- bytes moved: INT4 vs bf16 ---------------------------------------------------------------------------


def packed_weight(n: int, k: int, group: int | None, zeros: bool = True) -> Int4Weight:
    """A real packed INT4 weight of shape [N, K] (contents irrelevant to its size), bf16 metadata."""
    g = k if group is None else group
    n_groups = -(-k // g)
    scales = torch.empty(n_groups, n, dtype=torch.bfloat16)
    return Int4Weight(torch.empty(n, (k + 1) // 2, dtype=torch.uint8), scales,
                      torch.zeros_like(scales) if zeros else None, k, g)


def gemv_reduction_pct(n: int, k: int, group: int | None, zeros: bool = True, with_activations: bool = True,
                       ) -> float:
    """% fewer bytes an M=1 INT4 GEMV moves than the bf16 one (weights + metadata, plus x and y if asked)."""
    from reproductions.kernels.int4_bench import bytes_moved_bf16, bytes_moved_int4

    w = packed_weight(n, k, group, zeros)
    if with_activations:
        return 100.0 * (1 - bytes_moved_int4(w, 1) / bytes_moved_bf16(n, k, 1))
    bf16_weight = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
    return 100.0 * (1 - w.nbytes() / (bf16_weight.numel() * bf16_weight.element_size()))


def test_int4_bytes_moved_reduction(registry: Registry) -> None:
    shapes = {name: (n, k) for name, (n, k, _) in LLAMA_LAYER.items()} | {"lm_head": LM_HEAD}
    per_shape = {name: gemv_reduction_pct(n, k, 128) for name, (n, k) in shapes.items()}
    weights_only = {
        "g64_asym": gemv_reduction_pct(4096, 4096, 64, with_activations=False),
        "g128_asym": gemv_reduction_pct(4096, 4096, 128, with_activations=False),
        "g128_sym": gemv_reduction_pct(4096, 4096, 128, zeros=False, with_activations=False),
        "per_channel_asym": gemv_reduction_pct(4096, 4096, None, with_activations=False),
    }
    codes_only = 100.0 * (1 - 4 / 16)  # 4-bit codes vs 16-bit weights, no scales: the original 75.0% figure
    metrics = {"m1_g128_bytes_reduction_pct_min": min(per_shape.values()),
               "m1_g128_bytes_reduction_pct_max": max(per_shape.values()),
               "codes_only_reduction_pct": codes_only}
    metrics |= {f"m1_g128_bytes_reduction_pct.{k}": v for k, v in per_shape.items()}
    metrics |= {f"weights_only_reduction_pct.{k}": v for k, v in weights_only.items()}
    results = judge(registry, ["kernel-bandwidth-reduction"], suite="bytes_moved_cpu", metrics=metrics,
                    samples={"m1_g128_bytes_reduction_pct": list(per_shape.values())},
                    config={"shapes": shapes, "dtype": "bfloat16", "m": 1, "group_size": 128},
                    model="Llama-3.1-8B linear shapes (byte counting)")
    assert_consistent(results)
    claim = registry.claims["kernel-bandwidth-reduction"]
    low, high = claim.published  # the published range is exactly group 64 .. group 128 with zero-points
    assert weights_only["g64_asym"] == pytest.approx(low, abs=claim.tolerance)
    assert weights_only["g128_asym"] == pytest.approx(high, abs=claim.tolerance)
    assert codes_only == pytest.approx(claim.original)  # the original 75.0% ignored scales and zero-points
    assert weights_only["per_channel_asym"] > high + claim.tolerance  # per-channel metadata is negligible


# -- entropy: closed-form targets --------------------------------------------------------------------------


def two_level_logits(vocab: int, p_top: float) -> tuple[torch.Tensor, float]:
    """Logits where one token has probability p_top and the rest share 1 - p_top; and the exact entropy."""
    rest = (1 - p_top) / (vocab - 1)
    logits = torch.full((vocab,), math.log(rest), dtype=torch.float64)
    logits[0] = math.log(p_top)
    exact = -(p_top * math.log2(p_top) + (1 - p_top) * math.log2(rest))
    return logits, exact


def dyadic_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_entropy_closed_form(registry: Registry) -> None:
    exactly_representable = {  # logits exact in bf16 too: every dtype is checked
        "uniform_2": (torch.zeros(2), 1.0),
        "uniform_vocab_128256": (torch.zeros(128256), math.log2(128256)),  # the seed's "~17 bits": pure noise
        "one_hot": (torch.tensor([0.0, -math.inf, -math.inf]), 0.0),
    }
    fp32_only = {
        "dyadic_2.5_bits": (dyadic_logits([0.25, 0.25] + [0.125] * 4), 2.5),  # the seed's "~2.5 bits" target
        "dyadic_3.5_bits": (dyadic_logits([0.125] * 4 + [0.0625] * 8), 3.5),
        "two_level_p0.9_v32": two_level_logits(32, 0.9),
        "two_level_p0.5_v4096": two_level_logits(4096, 0.5),
    }
    errors = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cases = exactly_representable | (fp32_only if dtype == torch.float32 else {})
        for name, (logits, exact) in cases.items():
            errors[f"{name}|{dtype}"] = abs(float(entropy(logits.to(dtype))) - exact)
    tolerance_bits = 1e-4
    metrics = {"closed_form_entropies_match": max(errors.values()) < tolerance_bits,
               "max_abs_error_bits": max(errors.values()),
               "uniform_vocab_entropy_bits": float(entropy(torch.zeros(128256)))}
    results = judge(registry, ["entropy-closed-form"], suite="entropy_closed_form_cpu", metrics=metrics,
                    samples={"abs_error_bits": list(errors.values())},
                    config={"cases": list(errors), "tolerance_bits": tolerance_bits}, model="none")
    assert_consistent(results)
    assert metrics["uniform_vocab_entropy_bits"] == pytest.approx(16.97, abs=0.005)


def test_entropy_fp32_accuracy_at_llama_vocabulary() -> None:
    """fp32 at V=128256 within 1e-4 bits of the exact value (torch's CPU log_softmax alone is off by ~0.004)."""
    logits, exact = two_level_logits(128256, 0.5)  # [V] float64, exact entropy in bits
    assert abs(float(entropy(logits.float())) - exact) < 1e-4


# -- the clutch: hysteresis ---------------------------------------------------------------------------------


def run_clutch(config: ClutchConfig, trace: list[float]) -> tuple[list[bool], int]:
    clutch = EntropyClutch(config)
    states = [clutch.update(h) for h in trace]
    return states, clutch.flips


def test_clutch_hysteresis(registry: Registry) -> None:
    low, high = TUNED.theta_low, TUNED.theta_high
    mid = (low + high) / 2
    instant = ClutchConfig(theta_low=low, theta_high=high, alpha=1.0)  # EMA = latest value: a clean read-out
    # The same in-band entropy after a low excursion and after a high one: a Schmitt trigger remembers.
    after_low, _ = run_clutch(instant, [high + 1.0, low / 2, mid, mid, mid])
    after_high, _ = run_clutch(instant, [low / 2, high + 1.0, mid, mid, mid])
    holds = after_low[2:] == [True] * 3 and after_high[2:] == [False] * 3
    # In-band noise: the two-threshold clutch never flips; a single static threshold at mid chatters.
    noise = [mid + (0.2 if i % 2 else -0.2) * (high - low) for i in range(200)]
    _, band_flips = run_clutch(instant, [high + 1.0, *noise])
    static = ClutchConfig(theta_low=mid, theta_high=mid, alpha=1.0)
    _, static_flips = run_clutch(static, [high + 1.0, *noise])
    # The tuned EMA (alpha 0.65) as shipped: a long low stretch engages, a long in-band stretch keeps it.
    tuned_states, _ = run_clutch(TUNED, [high + 1.0] * 5 + [0.0] * 20 + [mid] * 50)
    tuned_holds = tuned_states[24] and all(tuned_states[25:])
    metrics = {"hysteresis_holds": holds and band_flips == 0 and static_flips > 0 and tuned_holds,
               "in_band_flips": band_flips, "static_threshold_flips": static_flips}
    results = judge(registry, ["clutch-hysteresis"], suite="clutch_hysteresis_cpu", metrics=metrics,
                    samples={"noise_trace_bits": noise},
                    config={"theta_low": low, "theta_high": high, "alpha": TUNED.alpha}, model="none")
    assert_consistent(results)
    assert static_flips >= len(noise) - 1  # the negative control chatters on every step


# -- speculative decoding: lossless greedy, and deterministic gate decisions ---------------------------------

PROMPTS = ([1, 5, 9, 3], [1, 40, 41, 42, 43, 44], [1, 7])
NEW_TOKENS = 40



@pytest.fixture(scope="module")
def tiny_pair() -> dict:
    from sdsie.models import perturbed_copy, tiny_llama

    target = tiny_llama(seed=0)
    return {"target": target, "scouts": {"random": tiny_llama(seed=123), "self": target,
                                         "perturbed": perturbed_copy(target, noise=0.3, seed=1)}}


def test_speculative_greedy_lossless(registry: Registry, tiny_pair: dict) -> None:
    from sdsie.decoding import DecodeConfig, generate

    target = tiny_pair["target"]
    plain = {i: generate(target, p, DecodeConfig(max_new_tokens=NEW_TOKENS)).tokens for i, p in enumerate(PROMPTS)}
    identical, acceptance = [], {}
    for name, scout in tiny_pair["scouts"].items():
        drafted = accepted = 0
        for k in (1, 3, 5):
            for i, prompt in enumerate(PROMPTS):
                out = generate(target, prompt, DecodeConfig(max_new_tokens=NEW_TOKENS, k_draft=k), scout=scout)
                identical.append(float(out.tokens == plain[i]))
                drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
        acceptance[name] = accepted / drafted
    metrics = {"greedy_identical": all(identical), "runs": len(identical)}
    metrics |= {f"acceptance.{name}": a for name, a in acceptance.items()}
    results = judge(registry, ["spec-lossless-greedy"], suite="speculative_lossless_cpu", metrics=metrics,
                    samples={"identical": identical},
                    config={"k": [1, 3, 5], "prompts": [list(p) for p in PROMPTS], "max_new_tokens": NEW_TOKENS,
                            "dtype": "float32", "scouts": list(acceptance)}, model="tiny Llama pair, fp32")
    assert_consistent(results)
    assert acceptance["self"] == 1.0  # self-drafting must accept everything
    assert acceptance["random"] < acceptance["self"]  # the scouts really differ: the equality is not vacuous


def test_decision_sequence_determinism(registry: Registry, tiny_pair: dict) -> None:
    from sdsie.decoding import DecodeConfig, generate

    target, scout = tiny_pair["target"], tiny_pair["scouts"]["perturbed"]
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    # Thresholds inside this model's own entropy range, so the clutch both engages and releases.
    h = sorted(c.entropy for p in PROMPTS for c in generate(target, p, config).cycles)
    clutch_config = ClutchConfig(theta_low=h[len(h) * 2 // 5], theta_high=h[len(h) * 3 // 5], alpha=TUNED.alpha)
    trials = 5
    sequences = [[[c.k for c in generate(target, p, config, scout=scout, clutch=EntropyClutch(clutch_config)).cycles]
                  for p in PROMPTS] for _ in range(trials)]
    identical = all(seq == sequences[0] for seq in sequences)
    flat = [k for prompt_seq in sequences[0] for k in prompt_seq]
    speculate_fraction = sum(k > 0 for k in flat) / len(flat)
    metrics = {"decisions_identical_across_trials": identical, "speculate_fraction": speculate_fraction,
               "cycles_per_trial": len(flat)}
    results = judge(registry, ["gated-decisions-bit-identical"], suite="decision_determinism_cpu", metrics=metrics,
                    samples={"k_trial0": [float(k) for k in flat]},
                    config={"theta_low": clutch_config.theta_low, "theta_high": clutch_config.theta_high,
                            "alpha": clutch_config.alpha, "trials": trials, "max_new_tokens": NEW_TOKENS},
                    model="tiny Llama pair, fp32", trials=trials)
    assert_consistent(results)
    assert 0 < speculate_fraction < 1, "the clutch must both speculate and fall back, or the test is vacuous"
