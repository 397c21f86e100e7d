"""Shared fixtures: tiny checkpoints written by transformers (the oracle)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def run_cli(*args: str, env: dict | None = None, timeout: int = 300):
    """Run `python -m tierlab ARGS` in a subprocess, as a user would."""
    import subprocess

    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([PYTHON, "-m", "tierlab", *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout)


@pytest.fixture(scope="session")
def opencl_device():
    """The tests of the GPU tier need an OpenCL device; CI has PoCL, so its absence fails them."""
    import pyopencl as cl

    try:
        found = any(p.get_devices() for p in cl.get_platforms())
    except cl.Error:
        found = False
    assert found, "no OpenCL device: pyopencl[pocl] should provide one"


@pytest.fixture(scope="session")
def oracle_models(tmp_path_factory):
    """name -> (hf model, folder): per-expert layouts of both archs, and the fused VL layout."""
    import oracle_models as om

    root = tmp_path_factory.mktemp("oracle")
    q35 = om.build_model(om.qwen3_5_config(), seed=1)
    q3 = om.build_model(om.qwen3_config(), seed=2)
    return {
        "qwen3_5_moe": (q35, om.save(q35, root / "qwen3_5_moe")),
        "qwen3_moe": (q3, om.save(q3, root / "qwen3_moe")),
        "qwen3_5_moe_fused_vl": (q35, om.write_fused_vl(q35, root / "qwen3_5_moe_fused_vl")),
    }


@pytest.fixture(scope="session")
def model_40x256(tmp_path_factory) -> Path:
    """A 40-layer × 256-expert Qwen3-MoE at tiny widths (tests/app_models.py): the app at real scale."""
    from app_models import build_wide_moe

    return build_wide_moe(tmp_path_factory.mktemp("wide") / "synthetic-40x256")
