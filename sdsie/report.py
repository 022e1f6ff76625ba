"""Reproduction reports: Markdown + JSON + PNG figures, built only from run records.

Per claim and record: the seed's figure and conditions, the measurement and the record's conditions, the
judgment against the seed's figure and the judgment against our own reference (two columns, never merged),
the environment of the record, and the path of every raw record used.

Figures read these record keys (a benchmark that wants a figure writes them); each figure is drawn
from the newest record that holds its data, or skipped with the reason:

    entropy_trace   samples "entropy_bits" and "k" (one value per decode step, same length);
                    optional samples "ema_bits"; optional config theta_low / theta_high
    j_per_token     metrics "j_per_token.<family>"; optional "j_per_token_baseline.<family>"
    clutch_sweep    samples "sweep.threshold", "sweep.engagement_pct", "sweep.tokens_per_s" (parallel)
    fidelity_layers samples "fidelity.layers" and "fidelity.match_pct.<family>" (parallel)
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sdsie.claims import REFERENCE_VERDICTS, ClaimResult, Evaluation, Registry, format_value, summary
from sdsie.telemetry.env import git_state, utc_now
from sdsie.telemetry.records import RunRecord, newest_record

__all__ = ["FIGURES", "FigureOutcome", "Report", "build_report", "citation_text", "progress"]

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """tqdm progress on a terminal (stderr), silent otherwise."""
    from tqdm import tqdm

    yield from tqdm(items, desc=desc, total=total, disable=not sys.stderr.isatty(), leave=False)


# -- figures ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FigureOutcome:
    name: str
    title: str
    path: Path | None
    record: RunRecord | None
    skipped: str | None = None


def _newest(records: Sequence[RunRecord], has: Callable[[RunRecord], bool]) -> RunRecord | None:
    return newest_record(records, accept=lambda r: r.complete and has(r))


def _prefixed(keys: Iterable[str], prefix: str) -> list[str]:
    return sorted(k[len(prefix):] for k in keys if k.startswith(prefix) and len(k) > len(prefix))


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _has_entropy_trace(r: RunRecord) -> bool:
    s = r.samples
    return "entropy_bits" in s and "k" in s and len(s["entropy_bits"]) == len(s["k"])


def _draw_entropy_trace(r: RunRecord, path: Path) -> None:
    plt = _plt()
    h, k = r.samples["entropy_bits"], r.samples["k"]
    steps = range(len(h))
    fig, (ax_h, ax_k) = plt.subplots(2, 1, sharex=True, figsize=(9, 5), height_ratios=[3, 1])
    ax_h.plot(steps, h, lw=0.8, label="entropy H(t)")
    if len(r.samples.get("ema_bits", [])) == len(h):
        ax_h.plot(steps, r.samples["ema_bits"], lw=1.2, label="EMA")
    for key, style in (("theta_low", "--"), ("theta_high", ":")):
        if isinstance(r.config.get(key), (int, float)):
            ax_h.axhline(r.config[key], color="k", ls=style, lw=0.8, label=key)
    ax_h.set_ylabel("bits")
    ax_h.legend(loc="upper right", fontsize=8)
    ax_k.step(steps, k, where="post", color="tab:green")
    ax_k.set_ylabel("k(t)")
    ax_k.set_xlabel("decode step")
    fig.suptitle("Entropy trace and draft length k(t)")
    _save(fig, path)


def _has_j_per_token(r: RunRecord) -> bool:
    return bool(_prefixed(r.metrics, "j_per_token."))


def _draw_j_per_token(r: RunRecord, path: Path) -> None:
    plt = _plt()
    families = _prefixed(r.metrics, "j_per_token.")
    x = range(len(families))
    base = [r.metrics.get(f"j_per_token_baseline.{f}") for f in families]
    fig, ax = plt.subplots(figsize=(7, 4))
    has_base = all(isinstance(b, (int, float)) for b in base)
    width = 0.4 if has_base else 0.6
    ax.bar([i - (width / 2 if has_base else 0) for i in x], [r.metrics[f"j_per_token.{f}"] for f in families],
           width, label="measured")
    if has_base:
        ax.bar([i + width / 2 for i in x], base, width, label="baseline")
    ax.set_xticks(list(x), families)
    ax.set_ylabel("J / token")
    ax.set_title("Energy per token by task family")
    ax.legend()
    _save(fig, path)


_SWEEP = ("sweep.threshold", "sweep.engagement_pct", "sweep.tokens_per_s")


def _has_sweep(r: RunRecord) -> bool:
    return all(k in r.samples for k in _SWEEP) and len({len(r.samples[k]) for k in _SWEEP}) == 1


def _draw_sweep(r: RunRecord, path: Path) -> None:
    plt = _plt()
    thr, eng, tps = (r.samples[k] for k in _SWEEP)
    order = sorted(range(len(thr)), key=thr.__getitem__)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([thr[i] for i in order], [eng[i] for i in order], "o-", label="engagement")
    ax.set_xlabel(str(r.config.get("sweep_threshold_label", "threshold")))
    ax.set_ylabel("clutch engagement (% of cycles)")
    ax2 = ax.twinx()
    ax2.plot([thr[i] for i in order], [tps[i] for i in order], "s--", color="tab:red", label="throughput")
    ax2.set_ylabel("tokens / s")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    ax.set_title("Clutch engagement vs threshold, with throughput")
    _save(fig, path)


def _has_fidelity(r: RunRecord) -> bool:
    if "fidelity.layers" not in r.samples:
        return False
    n = len(r.samples["fidelity.layers"])
    fams = _prefixed(r.samples, "fidelity.match_pct.")
    return bool(fams) and all(len(r.samples[f"fidelity.match_pct.{f}"]) == n for f in fams)


def _draw_fidelity(r: RunRecord, path: Path) -> None:
    plt = _plt()
    layers = r.samples["fidelity.layers"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for fam in _prefixed(r.samples, "fidelity.match_pct."):
        ax.plot(layers, r.samples[f"fidelity.match_pct.{fam}"], "o-", label=fam)
    if min(layers) > 0:
        ax.set_xscale("log", base=2)
    else:  # 0 gated layers (the full-precision control) has no place on a log axis
        ax.set_xscale("symlog", base=2, linthresh=1)
    ax.set_xticks(layers, [f"{x:g}" for x in layers])
    ax.set_xlabel("gated layers")
    ax.set_ylabel("exact token match vs full precision (%)")
    ax.set_ylim(-2, 102)
    ax.set_title("Fidelity vs number of INT4-gated layers")
    ax.legend()
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)


@dataclass(frozen=True)
class _FigureSpec:
    name: str
    title: str
    needs: str
    has: Callable[[RunRecord], bool]
    draw: Callable[[RunRecord, Path], None]


FIGURES = (
    _FigureSpec("entropy_trace", "Entropy trace with the k(t) panel", 'samples "entropy_bits" and "k" of equal length',
                _has_entropy_trace, _draw_entropy_trace),
    _FigureSpec("j_per_token", "J/token per task family", 'metrics "j_per_token.<family>"',
                _has_j_per_token, _draw_j_per_token),
    _FigureSpec("clutch_sweep", "Clutch engagement vs threshold, with throughput",
                'samples "sweep.threshold", "sweep.engagement_pct", "sweep.tokens_per_s"', _has_sweep, _draw_sweep),
    _FigureSpec("fidelity_layers", "Fidelity vs number of gated layers",
                'samples "fidelity.layers" and "fidelity.match_pct.<family>"', _has_fidelity, _draw_fidelity),
)


def draw_figures(records: Sequence[RunRecord], out_dir: Path) -> list[FigureOutcome]:
    out_dir.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for spec in progress(FIGURES, "figures"):
        record = _newest(records, spec.has)
        if record is None:
            outcomes.append(FigureOutcome(spec.name, spec.title, None, None,
                                          f"no complete record holds {spec.needs}"))
            continue
        path = out_dir / f"{spec.name}.png"
        spec.draw(record, path)
        outcomes.append(FigureOutcome(spec.name, spec.title, path, record))
    return outcomes


# -- citation ----------------------------------------------------------------------------------------------


def citation_text(cff_path: Path) -> str:
    """How to cite, from CITATION.cff (title, version, doi / url when present)."""
    if not cff_path.is_file():
        return f"No {cff_path.name} found; cite the repository URL and the git sha below."
    text = cff_path.read_text(encoding="utf-8")
    fields = {k: _cff_field(text, k) for k in ("title", "version", "doi", "url", "repository-code")}
    parts = [fields["title"] or "SDSIE"]
    if fields["version"]:
        parts.append(f"version {fields['version']}")
    link = fields["doi"] and f"https://doi.org/{fields['doi']}" or fields["repository-code"] or fields["url"]
    if link:
        parts.append(link)
    return (f"Cite with the metadata in `{cff_path.name}` (GitHub's 'Cite this repository' reads it): "
            f"{', '.join(parts)}. Give the git sha of the records you cite, listed below.")


def _cff_field(text: str, key: str) -> str | None:
    match = re.search(rf"^{re.escape(key)}:\s*[\"']?(.+?)[\"']?\s*$", text, re.MULTILINE)
    return match.group(1) if match else None


# -- report --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    markdown: Path
    json: Path
    figures: list[FigureOutcome]


def _rel(path: Path | None, base: Path) -> str | None:
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


def _env_summary(r: RunRecord) -> dict[str, Any]:
    env = r.environment
    gpu = env.get("gpu", {}) if isinstance(env.get("gpu"), dict) else {}
    git = env.get("git", {}) if isinstance(env.get("git"), dict) else {}
    packages = env.get("packages", {}) if isinstance(env.get("packages"), dict) else {}
    return {
        "git_sha": git.get("sha"), "git_dirty": git.get("dirty"), "date": env.get("date"),
        "gpu": gpu.get("name") or gpu.get("unavailable"), "driver": gpu.get("driver"),
        "power_limit_w": gpu.get("power_limit_w"), "python": env.get("python"),
        "torch": packages.get("torch"), "triton": packages.get("triton"), "transformers": packages.get("transformers"),
    }


def _expected_json(expected: Any) -> Any:
    """A band as [low, high]; exact values (bools, numbers) as they are."""
    if expected is None or isinstance(expected, (bool, int, float)):
        return expected
    return [expected.low, expected.high]


def _result_json(res: ClaimResult, root: Path) -> dict[str, Any]:
    c, seed, ref = res.claim, res.seed, res.reference
    return {
        "id": c.id, "area": c.area, "statement": c.statement, "quote": c.quote, "status": c.status, "kind": c.kind,
        "unit": c.unit, "published": c.published, "original": c.original, "portable": c.portable,
        "depends": list(c.depends), "seed_conditions": c.seed.as_dict(),
        "measured": res.measured, "record_conditions": None if res.conditions is None else res.conditions.as_dict(),
        "vs_seed": {"verdict": seed.verdict, "detail": seed.detail, "judged": seed.judged,
                    "expected": _expected_json(seed.expected), "direction": seed.direction,
                    "differs": list(seed.differs)},
        "vs_reference": None if ref is None else {
            "verdict": ref.verdict, "detail": ref.detail, "expected": _expected_json(ref.expected),
            "reference_record": None if ref.reference_record is None else _rel(ref.reference_record.source, root),
            "pinned_from": None if ref.reference is None else ref.reference.record},
        "failed": res.failed, "test": c.test,
        "record": None if res.record is None else _rel(res.record.source, root),
        "environment": None if res.record is None else _env_summary(res.record),
    }


def _md_cell(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _seed_cell(res: ClaimResult) -> str:
    seed = res.seed
    word = seed.verdict + (f" ({seed.direction})" if seed.direction and seed.verdict == "contradicted" else "")
    if seed.judged == "quality":
        word += ", on its quality"
    elif seed.verdict == "not comparable":
        word += f": {', '.join(seed.differs)} {'differs' if len(seed.differs) == 1 else 'differ'}"
    return word


def _markdown(evaluation: Evaluation, records: Sequence[RunRecord], figures: list[FigureOutcome],
              root: Path, out_dir: Path, registry: Registry, cite: str, git: dict[str, Any]) -> str:
    refs = {v: len(rs) for v, rs in evaluation.by_reference().items() if rs}
    gate = "FAIL" if evaluation.failed() else "PASS"
    lines = [
        "# SDSIE claims report", "",
        f"Generated {utc_now()} from {len(records)} record(s) at git {git.get('sha')}"
        f"{' (dirty)' if git.get('dirty') else ''}; registry `{_rel(registry.path, root)}`.", "",
        f"**Against the seed's figures:** {summary(evaluation)}", "",
        f"**Against our own references (claims gate: {gate}):** "
        + ", ".join(f"{v} {refs[v]}" for v in REFERENCE_VERDICTS if v in refs) + ".", "",
        "Two judgments per claim and record, kept apart. *vs seed*: *consistent* (within the seed's band), "
        "*contradicted* (outside it) or *not comparable* (the record's conditions differ from the seed's in "
        "something the figure depends on: model, GPU, prompts), judged only under comparable conditions; a "
        "*portable* claim (arithmetic, losslessness) is comparable everywhere, and a qualitative claim may be "
        "judged on its quality alone. *vs our reference*: *stable*, *improved* or *drifted* against the reference "
        "pinned for exactly the record's conditions (band, or rank test and effect size for timings); *no "
        "reference* is shown, not gated. The gate fails on *drifted*, *invalid* and a portable claim contradicted.",
        "", "## How to cite", "", cite, "",
    ]
    if evaluation.errors:
        lines += ["## Record errors", ""] + [f"- {e}" for e in evaluation.errors] + [""]
    lines += ["## Claims", "",
              "| claim | seed's figure | seed's conditions | measured | record's conditions | vs seed | "
              "vs our reference | record |", "|---|---|---|---|---|---|---|---|"]
    for res in evaluation.results:
        c = res.claim
        published = f"{format_value(c.published)} {c.unit}".strip()
        if c.original is not None:
            published += f" (orig. {format_value(c.original)})"
        measured = "-" if res.measured is None else format_value(res.measured)
        record = "-" if res.record is None else f"`{_rel(res.record.source, root)}`"
        cond = "-" if res.conditions is None else res.conditions.describe()
        ref = "-" if res.reference is None else res.reference.verdict
        ref = "- (portable)" if c.portable and res.record is not None else ref
        lines.append("| " + " | ".join(_md_cell(x) for x in (
            f"**{c.id}**: {c.statement}", published, "any (portable)" if c.portable else c.seed.describe(),
            measured, cond, _seed_cell(res), ref, record,
        )) + " |")
    lines += ["", "### Details", ""]
    for res in evaluation.results:
        ref = "" if res.reference is None else f" *vs our reference*: {res.reference.verdict}, {res.reference.detail}."
        lines.append(f"- **{res.claim.id}** *vs seed*: {res.seed.verdict}, {res.seed.detail}.{ref}")
    lines += ["", "## Figures", ""]
    for fig in figures:
        if fig.path is None:
            lines.append(f"- {fig.title}: skipped, {fig.skipped}.")
        else:
            src = _rel(fig.record.source, root) if fig.record else "-"
            lines += [f"### {fig.title}", "", f"![{fig.title}]({_rel(fig.path, out_dir)})", "",
                      f"From record `{src}`.", ""]
    lines += ["", "## Records", "", "| record | suite | created | model / hardware / N | git | GPU | torch |",
              "|---|---|---|---|---|---|---|"]
    for r in records:
        env = _env_summary(r)
        sha = (env["git_sha"] or "?")[:10] + ("+dirty" if env["git_dirty"] else "")
        cond = f"{r.conditions['model']} / {r.conditions['hardware']} / {r.conditions['trials']}"
        lines.append("| " + " | ".join(_md_cell(x) for x in (
            f"`{_rel(r.source, root)}`", r.suite, r.created, cond, sha, env["gpu"], env["torch"],
        )) + " |")
    return "\n".join(lines) + "\n"


def build_report(registry: Registry, records: Sequence[RunRecord], evaluation: Evaluation,
                 out_dir: str | Path = "reports", root: str | Path = ".") -> Report:
    """Write report.md, report.json and figures/*.png under `out_dir`; returns their paths."""
    out, root = Path(out_dir), Path(root)
    out.mkdir(parents=True, exist_ok=True)
    git = git_state(root)  # before anything is written: the tree the report was built from
    figures = draw_figures(records, out / "figures")
    cite = citation_text(root / "CITATION.cff")
    payload = {
        "generated": utc_now(), "git": git, "registry": _rel(registry.path, root),
        "gate_failed": evaluation.failed(), "record_errors": evaluation.errors,
        "seed_summary": summary(evaluation),
        "how_to_cite": cite,
        "claims": [_result_json(r, root) for r in evaluation.results],
        "records": [{"path": _rel(r.source, root), "record_id": r.record_id, "suite": r.suite,
                     "created": r.created, "claim_ids": r.claim_ids, "complete": r.complete,
                     "conditions": r.conditions, "environment": _env_summary(r)} for r in records],
        "figures": [{"name": f.name, "title": f.title, "path": _rel(f.path, out),
                     "record": None if f.record is None else _rel(f.record.source, root), "skipped": f.skipped}
                    for f in figures],
    }
    json_path, md_path = out / "report.json", out / "report.md"
    json_path.write_text(json.dumps(payload, indent=1, default=str) + "\n", encoding="utf-8")
    md_path.write_text(_markdown(evaluation, records, figures, root, out, registry, cite, git), encoding="utf-8")
    return Report(md_path, json_path, figures)
