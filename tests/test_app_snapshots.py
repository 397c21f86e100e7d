"""SVG snapshots of the main screen at the four sizes people use (80x24, 100x30, 160x48, 220x60), on
the shipped model and on a 40-layer × 256-expert model.

The real app and engine draw a fixed conversation, heatmap and meters (`settle_for_snapshot`): no
timings, replies or machine names reach the frame, so a clean clone draws the same pictures.
"""

from __future__ import annotations

import pytest

import tierlab
from test_app import make_app, settle_for_snapshot, tiny_model  # noqa: F401  (fixtures)

SIZES = [(80, 24), (100, 30), (160, 48), (220, 60)]
IDS = [f"{w}x{h}" for w, h in SIZES]


@pytest.mark.parametrize("size", SIZES, ids=IDS)
def test_shipped_model_snapshot(snap_compare, make_app, size):
    app = make_app(model_dir=tierlab.ASSETS_DIR / "tiny-moe", cache_slots=12)
    assert snap_compare(app, terminal_size=size, run_before=settle_for_snapshot)


@pytest.mark.parametrize("size", SIZES, ids=IDS)
def test_40_layers_256_experts_snapshot(snap_compare, make_app, model_40x256, size):
    app = make_app(model_dir=model_40x256, cache_slots=96)
    assert snap_compare(app, terminal_size=size, run_before=settle_for_snapshot)
