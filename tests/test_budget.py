"""The memory budget: parsing, what auto reads (MemAvailable, cgroup limits), the split into
whole cache slots per layer, and the one-line refusals."""

from __future__ import annotations

import pytest

from conftest import run_cli
from tierlab import ASSETS_DIR
from tierlab.engine.budget import (
    AUTO_MARGIN, AUTO_MARGIN_MIN, GIB, RUNTIME_BYTES, auto_budget, cgroup_limit, cgroup_limit_files, footprint,
    parse_ram_gb, plan_budget, ram_gb_setting, state_bytes,
)
from tierlab.engine.config import load_config
from tierlab.engine.errors import ModelError, SettingError
from tierlab.engine.options import EngineOptions

TINY = ASSETS_DIR / "tiny-moe"


@pytest.mark.parametrize("text", ["-1", "0", "nan", "inf", "abc", "8GB", "-0.5"])
def test_a_bad_budget_is_refused(text):
    with pytest.raises(SettingError, match="--ram-gb"):
        parse_ram_gb(text)


def test_budget_settings_flag_over_environment_over_auto():
    assert parse_ram_gb("auto") is None and parse_ram_gb("12.5") == 12.5
    assert ram_gb_setting(None, {}) == (None, "auto")
    assert ram_gb_setting(None, {"TIER_RAM_GB": "6"}) == (6.0, "TIER_RAM_GB")
    assert ram_gb_setting("3", {"TIER_RAM_GB": "6"}) == (3.0, "--ram-gb")
    assert ram_gb_setting("auto", {"TIER_RAM_GB": "6"}) == (None, "auto")
    with pytest.raises(SettingError, match="TIER_RAM_GB"):
        ram_gb_setting(None, {"TIER_RAM_GB": "lots"})


def test_cgroup_limits_are_read_from_v1_and_v2_files(tmp_path):
    v1, v2, none1, none2 = (tmp_path / n for n in ("v1", "v2", "none1", "none2"))
    v1.write_text("8589934592\n")
    v2.write_text("4294967296\n")
    none1.write_text("9223372036854771712\n")  # cgroup v1's "no limit"
    none2.write_text("max\n")
    assert cgroup_limit([v1, none1]) == 8 * GIB
    assert cgroup_limit([v1, v2, none2, tmp_path / "missing"]) == 4 * GIB
    assert cgroup_limit([none1, none2]) is None


def test_cgroup_files_follow_proc_self_cgroup(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("9:memory:/tl8\n0::/user.slice\n")
    files = cgroup_limit_files(proc, tmp_path / "fs")
    assert files[0] == tmp_path / "fs" / "memory" / "tl8" / "memory.limit_in_bytes"
    assert tmp_path / "fs" / "user.slice" / "memory.max" in files


def test_auto_is_the_lower_of_available_memory_and_the_cgroup_limit_less_the_margin(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20971520 kB\n")  # 20 GiB
    limit = tmp_path / "limit"
    limit.write_text(str(8 * GIB))
    assert auto_budget(meminfo, [limit]) == 8 * GIB - int(8 * GIB * AUTO_MARGIN)
    limit.write_text("max")
    assert auto_budget(meminfo, [limit]) == 20 * GIB - int(20 * GIB * AUTO_MARGIN)
    meminfo.write_text("MemAvailable:   1048576 kB\n")  # 1 GiB: the minimum margin applies
    assert auto_budget(meminfo, [limit]) == GIB - AUTO_MARGIN_MIN
    assert auto_budget(tmp_path / "no-meminfo", [limit]) is None  # no figure: no budget, every expert


def test_slots_per_layer_are_what_the_budget_leaves():
    cfg = load_config(TINY)
    fp = footprint(TINY, cfg)
    assert fp.dense_bytes > 0 and fp.n_moe_layers == cfg.n_layers
    fixed = fp.dense_bytes + state_bytes(cfg, 4096) + RUNTIME_BYTES
    slot = fp.blob_nbytes * fp.n_moe_layers
    assert plan_budget(cfg, fp, fixed + 5 * slot + slot // 2).slots == 5
    assert plan_budget(cfg, fp, fixed + 5 * slot - 1).slots == 4
    assert plan_budget(cfg, fp, 100 * GIB).slots == cfg.n_experts  # never more than every expert
    plan = plan_budget(cfg, fp, fixed + 3 * slot, "--ram-gb")
    assert plan.cache == 3 * slot and any("3 of 32 slots" in line for line in plan.lines())
    assert state_bytes(cfg, 8192) > state_bytes(cfg, 4096) > 0


def test_dense_weights_over_the_budget_or_no_slot_left_is_one_line():
    cfg = load_config(TINY)
    fp = footprint(TINY, cfg)
    with pytest.raises(ModelError, match="below the dense weights") as exc:
        plan_budget(cfg, fp, fp.dense_bytes // 2)
    assert "\n" not in str(exc.value)
    with pytest.raises(ModelError, match="less than one expert slot"):
        plan_budget(cfg, fp, fp.dense_bytes + RUNTIME_BYTES + 1)


def test_the_shipped_models_fit_whole_under_auto(monkeypatch):
    """Default behaviour: auto leaves the shipped models' cache at every expert."""
    monkeypatch.delenv("TIER_RAM_GB", raising=False)
    for name in ("tiny-moe", "tiny-moe-8x2"):
        folder = ASSETS_DIR / name
        if (folder / "config.json").exists():
            assert EngineOptions(folder).budget_plan().slots == load_config(folder).n_experts


def test_the_budget_sets_the_engines_cache_and_cache_wins():
    cfg = load_config(TINY)
    fp = footprint(TINY, cfg)
    ram_gb = (fp.dense_bytes + state_bytes(cfg, 4096) + RUNTIME_BYTES + 7 * fp.blob_nbytes * cfg.n_layers) / GIB
    engine = EngineOptions(TINY, ram_gb=ram_gb, warmup=False).open(with_tokenizer=False)
    try:
        assert engine.cache_slots() == 7
    finally:
        engine.close()
    assert EngineOptions(TINY, cache=3, ram_gb=ram_gb).budget_plan() is None


@pytest.mark.parametrize("flag,env", [(["--ram-gb", "-2"], {}), (["--ram-gb", "nan"], {}), (["--ram-gb", "x"], {}),
                                      ([], {"TIER_RAM_GB": "-1"}), (["--ram-gb", "0.001"], {})])
def test_bad_budgets_exit_2_with_one_line(flag, env):
    proc = run_cli("generate", "--model", str(TINY), "--prompt", "hi", "-n", "1", *flag, env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and ("--ram-gb" in lines[0] or "TIER_RAM_GB" in lines[0]) and "Traceback" not in proc.stderr


def test_verbose_prints_the_breakdown():
    proc = run_cli("generate", "--model", str(TINY), "--prompt", "hi", "-n", "1", "--ram-gb", "2", "--verbose")
    assert proc.returncode == 0, proc.stderr
    assert "memory budget 2.00 GiB (--ram-gb)" in proc.stderr and "32 of 32 slots per layer" in proc.stderr


def test_bench_rss_reports_peak_and_growth_against_the_budget():
    import json

    proc = run_cli("bench", "rss", "--model", str(TINY), "--ram-gb", "2", "--cache", "6", "--tokens", "40",
                   "--prompt-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["budget_bytes"] == 2 * GIB and report["origin"] == "--ram-gb"
    assert report["cache_slots"] == 6 and 0 <= report["cache_full_at"] < 40  # --cache wins over the budget
    assert 0 < report["rss_open"] <= report["peak_sampled"] <= report["peak_hwm"]
    assert report["peak_over_budget"] == report["peak_hwm"] / (2 * GIB) - 1
    bad = run_cli("bench", "rss", "--model", str(TINY), "--tokens", "0")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
