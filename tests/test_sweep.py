"""`tierlab sweep` on the shipped models: rows equal single eval runs, every runner gives the same rows,
interrupted sweeps keep their rows and resume, bad grids and Ray addresses are one line."""

from __future__ import annotations

import json
import struct
import xml.etree.ElementTree as ET
import zlib

import numpy as np
import pytest

import tierlab
from conftest import run_cli
from tierlab.app.cli.main import main
from tierlab.app.lab.evaluate import read_ref, write_ref
from tierlab.app.lab.sweep import (RowSettings, grid_rows, parse_grid, run_sweep)
from tierlab.app.lab.sweep_report import pareto_front, png_plot, svg_plot
from tierlab.engine.errors import TierlabError

MAIN = tierlab.ASSETS_DIR / "tiny-moe"
FIXTURE = tierlab.ASSETS_DIR / "tiny-moe-8x2"


def small_ref(model, tokens: int):
    prompt, full = read_ref(model / "ref.json")
    return prompt, full[: len(prompt) + tokens]


def by_label(rows):
    return {(r["row"], r["cache"]): r for r in rows}


def test_sweep_row_equals_eval_run(tmp_path, capsys):
    prompt, full = small_ref(FIXTURE, 24)
    ref = tmp_path / "ref.json"
    write_ref(ref, prompt, full)
    rows = grid_rows(parse_grid(["CACHE_ROUTE=1", "ROUTE_J=1"], 8), default_cache=4)
    swept = run_sweep(FIXTURE, prompt, full, rows, workers=1).rows
    assert [r["row"] for r in swept] == ["off", "CACHE_ROUTE=1 ROUTE_J=1"]
    for row, flags in zip(swept, ([], ["--cache-route", "1", "--route-j", "1"])):
        assert main(["eval", "--model", str(FIXTURE), "--ref", str(ref), "--cache", "4", "--ppl", "--json",
                     *flags]) in (0, 1)
        single = json.loads(capsys.readouterr().out)
        tf = single["tf_segments"][0]["meters"]
        assert row["tf_nll"] == single["tf_nll"]
        assert (row["ram_hits"], row["ram_misses"]) == (tf["ram_hits"], tf["ram_misses"])
        assert row["ram_hit"] * 100 == pytest.approx(tf["ram_hit"], abs=1e-12)
    base, lever = swept
    assert base["dnll"] == 0.0 and base["kl_mean"] == 0.0 and base["kl_p99"] == 0.0 and base["agree"] == 1.0
    assert base["flips"] == 0.0 and base["dnll_lo"] == 0.0 and base["dnll_hi"] == 0.0
    assert lever["ram_hit"] > base["ram_hit"] and lever["kl_mean"] > 0.0
    assert lever["dnll"] == pytest.approx(lever["tf_nll"] - base["tf_nll"], abs=1e-12)
    assert lever["dnll_lo"] <= lever["dnll"] <= lever["dnll_hi"]
    assert lever["miss_reduction"] == pytest.approx(1 - (1 - lever["ram_hit"]) / (1 - base["ram_hit"]))


def test_pool_serial_and_ray_rows_are_identical():
    prompt, full = small_ref(MAIN, 16)
    rows = grid_rows(parse_grid(["CACHE=6,8", "CACHE_ROUTE=1", "ROUTE_J=1,2"], 32), default_cache=32)
    assert len(rows) == 4
    serial = run_sweep(MAIN, prompt, full, rows, workers=1)
    pool = run_sweep(MAIN, prompt, full, rows, workers=2)
    ray = run_sweep(MAIN, prompt, full, rows, ray_address="local", ray_cpus=2)
    assert (serial.runner, pool.runner, ray.runner) == ("serial", "pool of 2", "ray")
    assert len(serial.rows) == 6  # a baseline per cache size, then the grid
    assert serial.rows == pool.rows == ray.rows
    by = by_label(serial.rows)
    assert by[("CACHE_ROUTE=1 ROUTE_J=1", 6)]["ram_hit"] > by[("off", 6)]["ram_hit"]


def test_interrupted_sweep_keeps_its_rows_and_resumes(tmp_path):
    prompt, full = small_ref(FIXTURE, 12)
    rows = grid_rows(parse_grid(["CACHE_ROUTE=1", "ROUTE_J=1,0"], 8), default_cache=4)
    out = tmp_path / "sweep.jsonl"
    seen = []

    def stop_after_two(line):
        seen.append(line)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(FIXTURE, prompt, full, rows, workers=1, out=out, progress=stop_after_two)
    kept = out.read_text().splitlines()
    assert len(kept) == 2
    with open(out, "a") as f:
        f.write('{"format": "tierlab-sweep-row", "key"')  # a line torn by a crash
    with pytest.raises(TierlabError, match="already exists"):
        run_sweep(FIXTURE, prompt, full, rows, workers=1, out=out)
    resumed = run_sweep(FIXTURE, prompt, full, rows, workers=1, out=out, resume=True)
    assert resumed.resumed == 2
    fresh = run_sweep(FIXTURE, prompt, full, rows, workers=1)
    assert resumed.rows == fresh.rows
    # another text is another sweep: nothing of this file is reused
    other = run_sweep(FIXTURE, prompt, full[:-1], rows, workers=1, out=out, resume=True)
    assert other.resumed == 0


def test_grid_parsing_and_the_front():
    grid = parse_grid(["CACHE=3,4", "CACHE_ROUTE=0,1", "ROUTE_MODE=prior"], 8)
    rows = grid_rows(grid, default_cache=8)
    assert rows[0] == RowSettings((("ROUTE_MODE", "prior"),), 3)  # CACHE_ROUTE=0 is the default: dropped
    assert rows[1].label == "CACHE_ROUTE=1 ROUTE_MODE=prior"
    pts = [{"row": "a", "ram_hit": 0.5, "dnll": 0.0}, {"row": "b", "ram_hit": 0.7, "dnll": 0.1},
           {"row": "c", "ram_hit": 0.6, "dnll": 0.2}, {"row": "d", "ram_hit": 0.9, "dnll": 0.1}]
    assert [r["row"] for r in pareto_front(pts)] == ["a", "d"]
    svg = ET.fromstring(svg_plot(pts))
    circles = [e for e in svg.iter() if e.tag.endswith("circle")]
    assert len(circles) == 4 + 2
    png = png_plot(pts)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    idat = png.index(b"IDAT")
    (size,) = struct.unpack(">I", png[idat - 4: idat])
    pixels = np.frombuffer(zlib.decompress(png[idat + 4: idat + 4 + size]), dtype=np.uint8)
    rows = pixels.reshape(height, 1 + 3 * width)[:, 1:].reshape(height, width, 3)
    assert (rows == (192, 57, 43)).all(axis=2).sum() > 100  # the front's line
    assert (rows == (44, 127, 184)).all(axis=2).sum() > 4 * 20  # four dots


def assert_one_line(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("grid,needles", [
    ("ROUTE_Q=1,2", ("ROUTE_Q", "unknown knob")),
    ("ROUTE_P=0.5,1.5", ("ROUTE_P", "above")),
    ("CACHE=0,4", ("CACHE", "outside 1..8")),
    ("ROUTE_MODE=fast", ("ROUTE_MODE", "not one of")),
])
def test_bad_grid_is_one_line(grid, needles):
    proc = run_cli("sweep", "--model", str(FIXTURE), "--ref", str(FIXTURE / "ref.json"), "--grid", grid)
    assert_one_line(proc, "--grid", *needles)


def test_unreachable_ray_keeps_finished_rows(tmp_path):
    prompt, full = small_ref(FIXTURE, 8)
    ref = tmp_path / "ref.json"
    write_ref(ref, prompt, full)
    out = tmp_path / "sweep.jsonl"
    args = ["sweep", "--model", str(FIXTURE), "--ref", str(ref), "--cache", "4", "--grid", "CACHE_ROUTE=1",
            "--grid", "ROUTE_J=1,0", "--out", str(out)]
    done = run_cli(*args, "--workers", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == 3
    before = out.read_bytes()
    proc = run_cli(*args, "--grid", "CACHE=3,4", "--resume", "--ray", "127.0.0.1:1", "--ray-timeout", "2")
    assert_one_line(proc, "--ray 127.0.0.1:1", "unreachable")
    assert out.read_bytes() == before


def test_sweep_on_a_session_log(tmp_path, capsys):
    prompt, full = small_ref(FIXTURE, 6)
    ref = tmp_path / "ref.json"
    write_ref(ref, prompt, full)
    log = tmp_path / "run.jsonl"
    assert main(["eval", "--model", str(FIXTURE), "--ref", str(ref), "--cache", "4", "--log", str(log)]) in (0, 1)
    capsys.readouterr()
    assert main(["sweep", "--model", str(FIXTURE), "--log", str(log), "--cache", "4", "--grid", "CACHE_ROUTE=1",
                 "--grid", "ROUTE_J=1", "--workers", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] >= 5
    assert [r["row"] for r in result["rows"]] == ["off", "CACHE_ROUTE=1 ROUTE_J=1"]


def test_paper_protocol_table(capsys):
    assert main(["sweep", "--protocol", "paper", "--model", str(FIXTURE), "--tokens", "8", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"    tierlab sweep --protocol paper --model {FIXTURE}") or "--protocol paper" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "×K" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["3 (1.5×K)", "4 (2×K)", "6 (3×K)"]
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        lru, belady = float(cells[1].rstrip("%")), float(cells[3].rstrip("%"))
        assert belady <= lru  # no eviction policy beats Belady on the same requests
        assert len(cells) == 5 + 3 * 3
