"""The package's public API imports in a fresh interpreter, without a lazy loader between the INT4 format, the
kernels and the layers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_public_api_imports_from_the_package_root_in_a_fresh_interpreter():
    # the kernels first: they import the format, which the layers import with the kernels
    code = (
        "import sdsie.kernels.int4_gemm, sdsie.quant\n"
        "from sdsie import (generate, DecodeConfig, EntropyClutch, ClutchConfig, gate_model, quantize_model,\n"
        "                   int4_matmul, EnergyMeter)\n"
        "from sdsie.int4_format import Int4Weight\n"
        "import sdsie.kernels.int4_gemm as k, sdsie.quant.linear as q\n"
        "assert k.Int4Weight is Int4Weight and q.Int4Weight is Int4Weight and sdsie.quant.Int4Weight is Int4Weight\n"
        "assert int4_matmul is k.int4_matmul and quantize_model is q.quantize_model\n"
        "assert not hasattr(sdsie.quant, '__getattr__')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_every_name_in_the_root_all_is_defined():
    import sdsie

    missing = [name for name in sdsie.__all__ if not hasattr(sdsie, name)]
    assert missing == []
    assert {"generate", "DecodeConfig", "quantize_model", "int4_matmul", "EnergyMeter"} <= set(sdsie.__all__)
