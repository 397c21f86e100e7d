"""`tierlab bench kernels --quick --json` runs as CI runs it and reports sane numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys

KINDS = ("fp32", "bf16", "int8", "int4")


def test_bench_kernels_quick_json():
    proc = subprocess.run(
        [sys.executable, "-m", "tierlab", "bench", "kernels", "--quick", "--json"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["bandwidth_gbs"] > 0 and math.isfinite(report["bandwidth_gbs"])
    for kind in KINDS:
        rate = report["matvec"][kind]
        assert rate > 0 and math.isfinite(rate), (kind, rate)
        assert report["roofline_share"][kind] > 0
        assert report["fused_expert"][kind] > 0
    assert report["expert_read_gbs"] > 0


def test_bench_without_a_benchmark_prints_help():
    proc = subprocess.run([sys.executable, "-m", "tierlab", "bench"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "kernels" in proc.stdout
