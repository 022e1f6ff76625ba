"""Task runner. `nox` runs the default CPU suite; GPU sessions are opt-in."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

TORCH_CPU = "torch==2.13.0"  # a local CPU build on the project's machines; never a CUDA wheel in CI


def _install(session: nox.Session, extras: str = "test") -> None:
    if session.venv_backend != "none":
        session.install(TORCH_CPU)
        session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU suite: unit and property tests (Triton kernels under TRITON_INTERPRET=1)."""
    _install(session)
    session.run("pytest", "-m", "not gpu", *session.posargs)


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    """ruff check over the package, tests, reproductions and this file."""
    if session.venv_backend != "none":
        session.install("ruff")
    session.run("ruff", "check", "sdsie", "tests", "reproductions", "noxfile.py", *session.posargs)
