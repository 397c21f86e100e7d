"""`tierlab bench kernels --quick --json` runs as CI runs it and reports sane numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

KINDS = ("fp32", "bf16", "int8", "int4")


def test_bench_kernels_quick_json():
    proc = subprocess.run(
        [sys.executable, "-m", "tierlab", "bench", "kernels", "--quick", "--json"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["bandwidth_gbs"] > 0 and math.isfinite(report["bandwidth_gbs"])
    assert report["bandwidth_gbs"] == max(report["bandwidth_runs_gbs"]) and len(report["bandwidth_runs_gbs"]) == 2
    from tierlab.engine.kernels import qmatvec

    assert report["int_path"] == qmatvec.INT_PATH
    assert qmatvec.INT_PATH == ("vnni" if qmatvec._VNNI else "avx2-int4" if qmatvec._AVX2_INT4 else "float")
    for kind in KINDS:
        rate = report["matvec"][kind]
        assert rate > 0 and math.isfinite(rate), (kind, rate)
        # each shape's share is against the stream read right before and after its calls
        shares = []
        for shape, (before, after) in report["shape_bandwidth_gbs"][kind].items():
            assert before > 0 and after > 0
            shares.append(report["matvec_by_shape"][kind][shape] * report["bytes_per_weight"][kind]
                          / ((before + after) / 2))
        assert len(shares) == 2
        assert report["roofline_share"][kind] > 0
        assert report["roofline_share"][kind] == pytest.approx(sum(shares) / 2, rel=0.02, abs=2e-3)
        assert report["fused_expert"][kind] > 0
    assert report["expert_read_gbs"] > 0


def test_bench_without_a_benchmark_prints_help():
    proc = subprocess.run([sys.executable, "-m", "tierlab", "bench"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "kernels" in proc.stdout


def test_bench_decode_json_on_a_dense_quantised_container(tmp_path):
    """`tierlab bench decode` runs end to end and its numbers add up (speed itself is not asserted)."""
    from tierlab import ASSETS_DIR

    out = tmp_path / "c"
    conv = subprocess.run(
        [sys.executable, "-m", "tierlab", "convert", "--model", str(ASSETS_DIR / "tiny-moe-8x2"), "--out", str(out),
         "--bits", "4", "--dense-bits", "4"], capture_output=True, text=True, timeout=240)
    assert conv.returncode == 0, conv.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "tierlab", "bench", "decode", "--model", str(out), "--tokens", "4",
         "--prompt-tokens", "6", "--cache", "4", "--json"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert (r["kind"], r["dense_kind"], r["cache_slots"], r["n_experts"]) == ("int4", "int4", 4, 8)
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["bandwidth_gbs"] > 0
    wb = r["weight_bytes"]
    assert wb["total"] == wb["dense"] + wb["experts"] + wb["lm_head"] > 0
    assert r["roofline_tok_s"] == pytest.approx(r["bandwidth_gbs"] * 1e9 / wb["total"])
    # the bandwidth read between chunks of 16 tokens (4 tokens: one chunk, two readings); the
    # share is the chunks' median, each chunk against the mean of the readings around it
    low, high = r["bandwidth_range"]
    assert not r["bandwidth_given"]
    assert 0 < low <= r["bandwidth_gbs"] <= high
    assert len(r["chunk_shares"]) == 1 and r["roofline_share"] == r["chunk_shares"][0] > 0
    assert r["roofline_share"] == pytest.approx(r["decode_tok_s"] * wb["total"] / ((low + high) / 2 * 1e9))
    assert 0.0 <= r["ram_hit"] <= 100.0 and r["disk_mb_per_token"] >= 0  # percent
    assert set(r["ms_per_token"]) >= {"attention", "deltanet", "router", "fetch", "compute", "lm_head"}
    # the state a token moves, counted by hand from the config: DeltaNet recurrence and conv
    # inputs read and written, KV cache read at the decode's middle position (6 + 4 / 2)
    cfg = json.loads((out / "config.json").read_text())
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, conv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    kinds = cfg["layer_types"]
    deltanet = 2 * 4 * (vh * dk * dv + (conv - 1) * (2 * kh * dk + vh * dv))
    kv = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4 * (6 + 4 / 2 + 1)
    assert r["state_bytes"] == int(kinds.count("linear_attention") * deltanet + kinds.count("full_attention") * kv)


def test_bench_decode_is_warm_by_default_and_cold_on_request():
    """Warm slots (filled by other traffic) read fewer experts from disk than empty ones; with every
    expert fitting, nothing is evicted, so warm misses can only be fewer."""
    from tierlab import ASSETS_DIR
    from tierlab.app.lab.bench_decode import run_decode_bench
    from tierlab.engine.model import load_engine

    engine = load_engine(ASSETS_DIR / "tiny-moe-8x2")
    try:
        warm = run_decode_bench(engine, prompt_tokens=8, decode_tokens=8, bandwidth_gbs=1.0)
        cold = run_decode_bench(engine, prompt_tokens=8, decode_tokens=8, bandwidth_gbs=1.0, cold=True)
    finally:
        engine.close()
    assert (warm.cold, cold.cold) == (False, True)
    assert cold.disk_mb_per_token > 0
    assert warm.disk_mb_per_token < cold.disk_mb_per_token
    assert warm.ram_hit > cold.ram_hit
    # a bandwidth given is taken as it is: every chunk's share against it
    assert warm.bandwidth_gbs == 1.0 and warm.bandwidth_range == [1.0, 1.0] and warm.bandwidth_given
    assert len(warm.chunk_shares) == 1
    assert warm.roofline_share == pytest.approx(warm.decode_tok_s / warm.roofline_tok_s)


@pytest.mark.parametrize("args, message", [
    (["--tokens", "0"], "--tokens and --prompt-tokens must be at least 1"),
    (["--prompt-tokens", "0"], "--tokens and --prompt-tokens must be at least 1"),
    (["--bandwidth", "0"], "--bandwidth must be a positive number of GB/s"),
    (["--bandwidth", "nan"], "--bandwidth must be a positive number of GB/s"),
])
def test_bench_decode_refuses_nonsense_counts(args, message):
    """A zero count or bandwidth is one line and exit 2, before the model loads (no traceback)."""
    from tierlab import ASSETS_DIR

    proc = subprocess.run([sys.executable, "-m", "tierlab", "bench", "decode", "--model", str(ASSETS_DIR / "tiny-moe"),
                           *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"tierlab: error: {message}"
