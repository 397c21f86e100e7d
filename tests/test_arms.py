"""Clean A/B arms: restored residency and heat, frozen HEAT_FILE, meters independent of arm order."""

from __future__ import annotations

from dataclasses import replace as dataclass_replace
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from tierlab.app.lab.ab import run_ab
from tierlab.app.lab.arms import ArmState
from tierlab.app.lab.evaluate import greedy_decode, read_ref
from tierlab.engine.errors import TierlabError
from tierlab.engine.heat import HeatProfile
from tierlab.engine.knobs import Knobs
from tierlab.engine.options import EngineOptions

MODEL = REPO / "assets" / "tiny-moe-8x2"
PROMPT, FULL = read_ref(MODEL / "ref.json")
N = 16
LEVER = "CACHE_ROUTE=1 ROUTE_J=1"


@pytest.fixture(scope="module")
def engine():
    eng = EngineOptions(MODEL, 3, knobs_from_env=False).open(with_tokenizer=False)
    yield eng
    eng.close()


def arm(engine, state: ArmState, knobs: str) -> dict:
    engine.knobs = Knobs.from_assignments(knobs)
    state.restore(engine)
    _, meters = greedy_decode(engine, PROMPT[:3], N)
    return {k: meters[k] for k in ("ram_hit", "ram_hits", "ram_misses", "shadow_hit", "vram_hit")}


def test_a_warm_state_is_restored_exactly_before_each_arm(engine):
    engine.knobs = Knobs()
    engine.cold_start()
    greedy_decode(engine, PROMPT[:12], 6)  # a warm cache, some heat
    state = ArmState.capture(engine)
    assert any(held for held in state.residency.ram if held)
    first = arm(engine, state, "CACHE_ROUTE=0")
    other = arm(engine, state, LEVER)
    again = arm(engine, state, "CACHE_ROUTE=0")
    assert first == again and first != other
    state.restore(engine)
    assert engine.residency_state() == state.residency
    assert np.array_equal(engine.heat, state.heat)
    # without the restore, an arm after the lever's sees what it left: the meters differ
    arm(engine, state, LEVER)
    assert engine.residency_state() != state.residency
    engine.knobs = Knobs()
    _, leaked = greedy_decode(engine, PROMPT[:3], N)
    assert leaked["ram_hits"] != first["ram_hits"]


def test_a_state_travels_as_json_and_refuses_another_model(engine):
    engine.cold_start()
    greedy_decode(engine, PROMPT[:8], 3)
    state = ArmState.capture(engine)
    back = ArmState.from_json(state.to_json())
    assert back.residency == state.residency and back.fingerprint == state.fingerprint
    alien = ArmState("sha256:" + "0" * 64, state.residency, state.heat)
    with pytest.raises(TierlabError, match="cannot be restored"):
        alien.restore(engine)


def test_identical_arms_give_identical_meters_whichever_runs_first():
    forward = run_ab(MODEL, PROMPT, FULL[: len(PROMPT) + N], [LEVER, "off", LEVER], repeat=0,
                     default_engine={"CACHE": "3"}, tf_nll=True)
    backward = run_ab(MODEL, PROMPT, FULL[: len(PROMPT) + N], ["off", LEVER], repeat=0,
                      default_engine={"CACHE": "3"}, tf_nll=True)
    a, off, b = forward
    assert a.meters["ram_hits"] == b.meters["ram_hits"] == backward[1].meters["ram_hits"]
    assert a.tf_meters["ram_hits"] == b.tf_meters["ram_hits"] == backward[1].tf_meters["ram_hits"]
    assert off.meters["ram_hits"] == backward[0].meters["ram_hits"]
    assert a.tf_nll == b.tf_nll == backward[1].tf_nll
    # paired with the first row: the third row is the first row again
    assert b.paired["kl_p99"] == 0.0 and b.paired["agree"] == 1.0 and b.verdict.passed
    assert backward[1].paired["kl_mean"] > 0


def test_arms_never_write_the_heat_file(tmp_path):
    heat = tmp_path / "heat.json"
    cfg_layers, cfg_experts = 4, 8
    counts = np.arange(cfg_layers * cfg_experts, dtype=np.int64).reshape(cfg_layers, cfg_experts)
    HeatProfile(cfg_layers, cfg_experts, counts).write(str(heat))
    before = heat.read_bytes()
    run_ab(MODEL, PROMPT, FULL[: len(PROMPT) + 6], ["off", LEVER], repeat=1,
           default_engine={"CACHE": "3", "HEAT_FILE": str(heat)}, tf_nll=False)
    assert heat.read_bytes() == before
    absent = tmp_path / "none.json"
    run_ab(MODEL, PROMPT, FULL[: len(PROMPT) + 4], ["off"], repeat=0,
           default_engine={"CACHE": "3", "HEAT_FILE": str(absent)}, tf_nll=False)
    assert not Path(absent).exists()


def test_the_gpu_tier_residents_are_restored(opencl_device):
    from tierlab.engine.tiering import TierOptions

    stats_probe = EngineOptions(MODEL, 3, knobs_from_env=False).open(with_tokenizer=False)
    blob_gib = stats_probe.store_stats().blob_nbytes / 2**30
    stats_probe.close()
    tier = TierOptions(enabled=True, budget=str(5.5 * blob_gib))  # room for 5 experts
    eng = EngineOptions(MODEL, 3, tier, knobs_from_env=False).open(with_tokenizer=False)
    try:
        assert eng.tier_description() is not None
        state = ArmState.capture(eng)
        residents = state.residency.tier
        assert len(residents) == 5
        first = arm(eng, state, "off")
        # another arm's tier: the warmstart residents replaced by others
        layer, _ = residents[0]
        free = next(e for e in range(8) if (layer, e) not in residents)
        eng.restore_residency(dataclass_replace(state.residency, tier=(*residents[1:], (layer, free))))
        assert eng.residency_state().tier != residents
        again = arm(eng, state, "off")
        assert eng.residency_state().tier == residents
        assert again == first and first["vram_hit"] > 0
    finally:
        eng.close()
