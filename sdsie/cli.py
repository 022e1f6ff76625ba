"""The `sdsie` command.

    sdsie claims check [--records telemetry] [--registry reproductions/claims.toml] [--strict]
    sdsie claims list  [--records ...] [--registry ...]   both judgments per claim, with conditions and record
    sdsie claims pin RECORD [--claim ID ...]     print a [[reference]] block pinned from a reviewed record
    sdsie report [--records telemetry] [--registry ...] [--out reports]
    sdsie tune-int4 --shape NxK [--gate-up NxK] [--m 1 2 4 8 16] [--group 128 pc]   the INT4 kernel, for this GPU

Adding a subcommand: write `configure(parser)` and `run(args) -> exit code`, then
`register(Subcommand("name", "help", configure, run))` (at import of this module, or from a
module imported by it). Exit codes: 0 ok, 1 the gate failed or input was bad, 2 usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Subcommand", "SUBCOMMANDS", "build_parser", "main", "register"]

DEFAULT_RECORDS = "telemetry"
DEFAULT_REGISTRY = "reproductions/claims.toml"


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register(sub: Subcommand) -> None:
    """Add a top-level subcommand; names are unique."""
    if sub.name in SUBCOMMANDS:
        raise ValueError(f"subcommand {sub.name!r} is already registered")
    SUBCOMMANDS[sub.name] = sub


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdsie", description="SDSIE: the claims gate, reports, the server and "
                                     "INT4 kernel tuning.")
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for sub in SUBCOMMANDS.values():
        p = subs.add_parser(sub.name, help=sub.help, description=sub.help)
        sub.configure(p)
        p.set_defaults(_run=sub.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fidelity"]:  # its own parser: every option passes through unchanged
        from sdsie.fidelity import fidelity_main

        return int(fidelity_main(argv[1:]))
    args = build_parser().parse_args(argv)
    return int(args._run(args))


def _err(message: str) -> None:
    print(message, file=sys.stderr)


# -- claims ---------------------------------------------------------------------------------------------


def _add_inputs(p: argparse.ArgumentParser, records: bool = True) -> None:
    p.add_argument("--registry", default=DEFAULT_REGISTRY, help=f"claims registry (default {DEFAULT_REGISTRY})")
    if records:
        p.add_argument("--records", default=DEFAULT_RECORDS, help=f"records directory (default {DEFAULT_RECORDS})")


def _configure_claims(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser("check", help="judge the newest records against the registry (the CI gate)")
    _add_inputs(check)
    check.add_argument("--strict", action="store_true",
                       help="also fail on unmeasured claims, claims without a reference, and missing tests")
    check.add_argument("--root", default=".", help="repository root for test node ids (default .)")
    check.set_defaults(_claims=_claims_check)
    listing = actions.add_parser("list", help="each claim judged vs the seed and vs our reference, with conditions")
    _add_inputs(listing)
    listing.set_defaults(_claims=_claims_list)
    pin = actions.add_parser("pin", help="print [[reference]] entries for a reviewed record's conditions")
    _add_inputs(pin, records=False)
    pin.add_argument("record", help="path of the record to pin")
    pin.add_argument("--claim", action="append", default=None, help="only these claim ids (repeatable)")
    pin.set_defaults(_claims=_claims_pin)


def _run_claims(args: argparse.Namespace) -> int:
    return int(args._claims(args))


def _load_inputs(args: argparse.Namespace, records: bool = True):  # -> (Registry, list[RunRecord]) | None
    from sdsie.claims import RegistryError, load_registry
    from sdsie.telemetry.records import RecordError, load_records

    try:
        registry = load_registry(args.registry)
        loaded = load_records(args.records) if records else []
    except (RegistryError, RecordError) as err:
        _err(f"FAIL: {err}")
        return None
    return registry, loaded


def _claims_check(args: argparse.Namespace) -> int:
    from sdsie.claims import evaluate, missing_tests, summary

    inputs = _load_inputs(args)
    if inputs is None:
        return 1
    registry, records = inputs
    evaluation = evaluate(registry, records)
    failing = [r for r in evaluation.results if r.failed]
    for res in [*failing, *(r for r in evaluation.results if not r.failed)]:
        label = "FAIL" if res.failed else "ok"
        where = "" if res.record is None else f"\n{'':6}record: {res.record.source or res.record.record_id}"
        print(f"{label:<5} {res.summary()}{where}")
    for error in evaluation.errors:
        print(f"ERROR {error}")
    missing = missing_tests(registry, args.root)
    for entry in missing:
        print(f"MISSING TEST {entry}")
    refs = ", ".join(f"{v} {len(rs)}" for v, rs in evaluation.by_reference().items() if rs)
    failed = evaluation.failed(strict=args.strict) or (args.strict and bool(missing))
    print(f"\n{summary(evaluation)}")
    print(f"vs our references: {refs or 'none'}.")
    print(f"claims gate {'FAILED' if failed else 'passed'}: {len(records)} record(s), "
          f"{len(failing)} failing judgment(s)")
    return 1 if failed else 0


def _claims_list(args: argparse.Namespace) -> int:
    from sdsie.claims import evaluate, format_value, summary

    inputs = _load_inputs(args)
    if inputs is None:
        return 1
    registry, records = inputs
    evaluation = evaluate(registry, records)
    for res in evaluation.results:
        c = res.claim
        measured = "-" if res.measured is None else format_value(res.measured)
        ref = "-" if res.reference is None else res.reference.verdict
        print(f"{c.id:<36} seed {format_value(c.published)} {c.unit} | measured {measured} | "
              f"vs seed: {res.seed.verdict} | vs reference: {ref}")
        print(f"{'':<36} seed conditions: {c.seed.describe()}")
        if res.conditions is not None and res.record is not None:
            print(f"{'':<36} record conditions: {res.conditions.describe()}; record {res.record.record_id}")
    print(f"\n{summary(evaluation)}")
    return 0


def _toml_value(v: object) -> str:
    import json

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return f"[{', '.join(_toml_value(x) for x in v)}]"
    return repr(float(v)) if isinstance(v, (int, float)) else json.dumps(v)


def _claims_pin(args: argparse.Namespace) -> int:
    from sdsie.claims import judge_record
    from sdsie.telemetry.records import RecordError, load_record

    inputs = _load_inputs(args, records=False)
    if inputs is None:
        return 1
    registry = inputs[0]
    try:
        record = load_record(args.record)
    except RecordError as err:
        _err(f"FAIL: {err}")
        return 1
    declared = registry.claim_ids_of(record)  # the record's own ids, corrected by any [[erratum]]
    status, values = 0, {}
    for cid in args.claim or declared:
        claim = registry.claims.get(cid)
        if claim is None or cid not in declared:
            _err(f"skip {cid}: {'not in the registry' if claim is None else 'not declared by this record'}")
            status = 1
            continue
        if claim.portable or not claim.measurable:
            _err(f"skip {cid}: {'portable (no per-conditions reference)' if claim.portable else 'not measurable'}")
            continue
        res = judge_record(claim, record, registry)
        if res.reference is not None and res.reference.verdict == "invalid":
            _err(f"skip {cid}: {res.reference.detail}")
            status = 1
            continue
        values[cid] = res.measured
    if values:
        print(_reference_block(registry.conditions_of(record), record, values))
    return status


def _reference_block(cond, record, values: dict) -> str:  # noqa: ANN001 - Conditions, RunRecord
    lines = ["[[reference]]", f"model = {_toml_value(cond.model)}", f"hardware = {_toml_value(cond.hardware)}"]
    if cond.prompts is not None:
        lines.append(f"prompts = {_toml_value(cond.prompts)}")
    lines += [f"record = {_toml_value(record.record_id)}",
              f"note = {_toml_value(f'Pinned from record {record.record_id} (say in one sentence why it holds).')}",
              "[reference.values]"]
    lines += [f"{cid} = {_toml_value(v)}" for cid, v in values.items()]
    return "\n".join(lines) + "\n"


# -- report ------------------------------------------------------------------------------------------------


def _configure_report(p: argparse.ArgumentParser) -> None:
    _add_inputs(p)
    p.add_argument("--out", default="reports", help="output directory (default reports)")
    p.add_argument("--root", default=".", help="repository root (CITATION.cff, relative paths)")


def _run_report(args: argparse.Namespace) -> int:
    from sdsie.claims import evaluate
    from sdsie.report import build_report

    inputs = _load_inputs(args)
    if inputs is None:
        return 1
    registry, records = inputs
    evaluation = evaluate(registry, records)
    report = build_report(registry, records, evaluation, Path(args.out), Path(args.root))
    print(f"wrote {report.markdown} and {report.json}")
    for fig in report.figures:
        print(f"  figure {fig.name}: {fig.path if fig.path else 'skipped, ' + str(fig.skipped)}")
    return 0


register(Subcommand("claims", "the claims registry: check (CI gate), list, pin", _configure_claims, _run_claims))
register(Subcommand("report", "Markdown + JSON reproduction report with figures, from records",
                    _configure_report, _run_report))



def _configure_fidelity(p: argparse.ArgumentParser) -> None:
    p.description = "Listed for --help; main() hands `sdsie fidelity ...` to sdsie.fidelity.fidelity_main."


def _run_fidelity(ns: argparse.Namespace) -> int:  # pragma: no cover - main() dispatches before argparse
    from sdsie.fidelity import fidelity_main

    return fidelity_main([])


register(Subcommand("fidelity", "token match of INT4-gated layers vs full precision, per scheme and layer count",
                    _configure_fidelity, _run_fidelity))


# -- serve (options in sdsie.serve.cli; fastapi and uvicorn are imported only when it runs) -------------------


def _configure_serve(p: argparse.ArgumentParser) -> None:
    from sdsie.serve.cli import configure

    configure(p)


def _run_serve(args: argparse.Namespace) -> int:
    from sdsie.serve.cli import run

    return run(args)


register(Subcommand("serve", "OpenAI-compatible server (batch 1) where the clutch gates the scout and the gear",
                    _configure_serve, _run_serve))


# -- tune-int4 (torch and Triton are imported only when it runs: sdsie.kernels.int4_tune) ------------------------

TUNED_M = (1, 2, 4, 8, 16)  # sdsie.kernels.int4_config.TUNED_M, the M buckets a tuned entry serves


def shape_arg(text: str) -> tuple[int, int]:
    """argparse type of an NxK shape (`parse_shape`), its error naming the text: `tune-int4` and the probes."""
    from sdsie.kernels.int4_config import parse_shape

    try:
        return parse_shape(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _group(text: str) -> int | None:
    if text == "pc":
        return None
    try:
        g = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a group is a number of codes (128) or pc (per channel), got {text!r}") \
            from None
    if g < 1:
        raise argparse.ArgumentTypeError(f"a group size is >= 1, got {g}")
    return g


def _configure_tune(p: argparse.ArgumentParser) -> None:
    p.description = ("Time every configuration the INT4 kernel's choice can return for each shape, on this GPU, and "
                     "keep the fastest in the local tuned cache that select_config reads first "
                     "(sdsie.kernels.int4_tune).")
    p.add_argument("--shape", type=shape_arg, action="append", default=[], metavar="NxK",
                   help="a weight of N out and K in features (repeat for more)")
    p.add_argument("--gate-up", type=shape_arg, action="append", default=[], metavar="NxK",
                   help="a fused [gate; up] weight whose layer asks for silu(gate) * up (repeat for more)")
    p.add_argument("--m", type=int, nargs="+", choices=TUNED_M, default=list(TUNED_M),
                   help="rows of x: the buckets to tune (default all)")
    p.add_argument("--group", type=_group, nargs="+", default=[128], metavar="G",
                   help="group sizes along K, or pc for per channel (default 128)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu: a dry run under the Triton "
                   "interpreter, whose times mean nothing")
    p.add_argument("--cache", type=Path, default=None,
                   help="the tuned cache to write (default $SDSIE_INT4_CACHE, else $SDSIE_CACHE/int4_tuned.json)")
    p.add_argument("--no-write", dest="write", action="store_false", help="time and report, keep nothing")
    p.add_argument("--out", type=Path, default=None, help="also write every case's times and errors as JSON here")
    p.add_argument("--list", action="store_true", help="print the cases and their candidates, time nothing")


def _run_tune(args: argparse.Namespace) -> int:
    from sdsie.kernels.int4_tune import run

    return run(args)


register(Subcommand("tune-int4", "tune the INT4 kernel's configurations for this GPU and these shapes (local cache)",
                    _configure_tune, _run_tune))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
