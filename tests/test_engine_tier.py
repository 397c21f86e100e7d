"""The GPU tier inside the engine, on PoCL: same results, VRAM hit meter, heat-planned warmstart, failures."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_cli
from tierlab.engine.heat import HeatProfile
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine
from tierlab.engine.tiering import TierOptions

pytestmark = pytest.mark.usefixtures("opencl_device")
PROMPT = [int(i) for i in np.random.default_rng(11).integers(2, 250, 12)]
N = 12
EXPERT_GIB = 24576 / 2**30  # one fp32 expert of the oracle models (3 x 32 x 64 x 4 bytes)


def decode(engine):
    logits = [engine.prefill(PROMPT)]
    for _ in range(N):
        logits.append(engine.step(int(np.argmax(logits[-1]))))
    return np.stack(logits)


def engine_with(folder, tier: TierOptions | None, cache=3, **knobs):
    return load_engine(folder, cache_slots=cache, knobs=Knobs.from_env({}, **knobs),
                       tier=tier or TierOptions(enabled=False))


@pytest.fixture(scope="module")
def folder(oracle_models):
    return oracle_models["qwen3_5_moe"][1]


def test_tier_on_matches_tier_off(folder):
    off = decode(engine_with(folder, None))
    engine = engine_with(folder, TierOptions(enabled=True, budget=str(12 * EXPERT_GIB)))
    assert engine.tier_description() is not None
    on = decode(engine)
    assert np.abs(on - off).max() <= 1e-5 * np.abs(off).max()
    assert np.array_equal(on.argmax(1), off.argmax(1))
    m = engine.meters()
    assert 0 < m["vram_hit"] < 1 and m["tier_residents"] == 12
    assert engine.tier_description()["warmstart"] == "index"


def test_heat_planned_warmstart_beats_index_order(folder, tmp_path):
    heat = tmp_path / "heat.bin"
    first = engine_with(folder, TierOptions(heat_file=str(heat)))
    decode(first)
    first.close()
    profile = HeatProfile.read(heat, 4, 8)
    assert profile.counts.sum() == (len(PROMPT) + N) * 4 * 2
    budget = str(8.5 * EXPERT_GIB)
    index = engine_with(folder, TierOptions(enabled=True, budget=budget))
    planned = engine_with(folder, TierOptions(enabled=True, budget=budget, heat_file=str(heat)))
    decode(index)
    decode(planned)
    assert planned.tier_description()["warmstart"] == "heat"
    assert planned.meters()["vram_hit"] > index.meters()["vram_hit"]


def test_lever_swaps_to_vram(folder):
    # half of layer 0 on the device: inside that layer the lever has residents to prefer
    engine = engine_with(folder, TierOptions(enabled=True, budget=str(4.5 * EXPERT_GIB)), cache=2,
                         CACHE_ROUTE="1", ROUTE_J="1")
    decode(engine)
    m = engine.meters()
    assert m["swaps_to_vram"] > 0 and m["swaps_to_vram"] <= m["swaps"]


def test_invalid_device_name_falls_back_to_cpu(folder):
    engine = engine_with(folder, TierOptions(enabled=True, device="no-such-device-xyz"))
    assert engine.tier_description() is None
    assert any("no-such-device-xyz" in n for n in engine.notices)
    assert np.array_equal(decode(engine), decode(engine_with(folder, None)))


def test_device_lost_mid_run_continues_on_cpu(folder, monkeypatch):
    from tierlab.engine.tiers.opencl_tier import OpenCLTier, TierFailure

    off = decode(engine_with(folder, None))
    engine = engine_with(folder, TierOptions(enabled=True, budget=str(40 * EXPERT_GIB)))
    calls = {"n": 0}
    real = OpenCLTier.enqueue

    def flaky(tier, layer, experts, x):
        calls["n"] += 1
        if calls["n"] > 5:
            raise TierFailure("device lost (test)")
        return real(tier, layer, experts, x)

    monkeypatch.setattr(OpenCLTier, "enqueue", flaky)
    engine.notices.clear()
    on = decode(engine)
    assert engine.tier_description() is None
    assert np.abs(on - off).max() <= 1e-5 * np.abs(off).max()
    assert [n for n in engine.notices if "GPU tier" in n] == ["GPU tier off: device lost (test); experts run on the CPU"]


def test_device_failing_while_collecting_mid_generation_is_handled_in_the_store(folder, monkeypatch):
    """The tier's own failure path (a cl.Error while collecting): the store drops the tier, the
    tokens are those of a CPU-only run, and the user reads one notice."""
    import pyopencl as cl

    from tierlab.engine.tiers.opencl_tier import OpenCLTier

    class LostEvent:
        def wait(self):
            raise cl.RuntimeError("clWaitForEvents failed: EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST")

    off = decode(engine_with(folder, None))
    engine = engine_with(folder, TierOptions(enabled=True, budget=str(40 * EXPERT_GIB)))
    calls = {"n": 0}
    real = OpenCLTier.collect

    def failing(tier, handle):
        calls["n"] += 1
        if calls["n"] > 7 and handle.done is not None:
            handle.done.wait()
            handle.done = LostEvent()
        return real(tier, handle)

    monkeypatch.setattr(OpenCLTier, "collect", failing)
    engine.notices.clear()
    on = decode(engine)
    assert engine.tier_description() is None
    assert np.array_equal(on.argmax(1), off.argmax(1))
    assert np.abs(on - off).max() <= 1e-5 * np.abs(off).max()
    assert len([n for n in engine.notices if "GPU tier" in n]) == 1
    assert engine.store_stats().tier_on is False


def test_cli_tier_and_bad_budget(folder, tmp_path):
    proc = run_cli("ref", "--model", str(folder), "--prompt-ids", "3,4,5", "-n", "2", "-o", str(tmp_path / "r.json"),
                   "--tier", "--tier-gb", "lots")
    assert proc.returncode == 2 and "TIER_GB" in proc.stderr and "Traceback" not in proc.stderr


def test_read_only_heat_file_is_kept(folder, tmp_path):
    heat = tmp_path / "heat.bin"
    engine = engine_with(folder, TierOptions(heat_file=str(heat)))
    decode(engine)
    engine.close()
    before = heat.read_bytes()
    heat.chmod(0o444)
    engine = engine_with(folder, TierOptions(heat_file=str(heat)))
    decode(engine)
    engine.close()
    assert heat.read_bytes() == before
    assert any("read-only" in n for n in engine.notices)
