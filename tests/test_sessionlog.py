"""Session logs: writing, reading through damage, and the A/B table built from them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from tierlab.app.lab.abtable import knob_label, render_markdown, render_text, summarise_log, summarise_logs
from tierlab.app.lab.belady import belady_hits, lru_hits
from tierlab.engine.errors import FormatError
from tierlab.engine.events import TokenEvent
from tierlab.engine.knobs import KnobChange, KnobValues
from tierlab.engine.meters import MeterFold
from tierlab.engine.routing import Router
from tierlab.engine.sessionlog import (
    FORMAT_NAME,
    FORMAT_VERSION,
    SessionLogWarning,
    SessionLogWriter,
    read_session_log,
)

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"
if not PYTHON.exists():  # CI may run the suite from another environment
    PYTHON = Path(sys.executable)

N_LAYERS, N_EXPERTS, TOP_K, RAM_SLOTS = 3, 8, 2, 4
MODEL = {"path": "fixtures/tiny", "arch": "qwen3_moe", "n_layers": N_LAYERS, "n_experts": N_EXPERTS, "top_k": TOP_K}


def simulate_run(path: Path, knobs: KnobValues, n_tokens: int = 40, with_true_weights: bool = True, seed: int = 0):
    """A stand-in engine: per-layer LRU caches of RAM_SLOTS experts and a Router, logging every token.

    Returns the events and the summary of a MeterFold fed with them (the live meters)."""
    rng = np.random.default_rng(seed)
    router = Router(N_LAYERS, N_EXPERTS, TOP_K, norm_topk_prob=True)
    caches = [OrderedDict() for _ in range(N_LAYERS)]
    skew = rng.normal(size=(N_LAYERS, N_EXPERTS)) * 1.5
    events = []
    fold = MeterFold()
    with SessionLogWriter(path, model=MODEL, knobs=knobs, cache={"ram_slots": RAM_SLOTS}) as log:
        for t in range(n_tokens):
            layers = []
            for layer in range(N_LAYERS):
                logits = (skew[layer] + rng.normal(size=N_EXPERTS)).astype(np.float32)
                probs = np.exp(logits - logits.max())
                probs = (probs / probs.sum()).astype(np.float32)
                level = np.array([1 if e in caches[layer] else 0 for e in range(N_EXPERTS)], dtype=np.int8)
                route = router.select(layer, logits, probs, level, knobs)
                hits = misses = 0
                for e in route.chosen:
                    cache = caches[layer]
                    if e in cache:
                        hits += 1
                        cache.move_to_end(e)
                    else:
                        misses += 1
                        cache[e] = True
                        while len(cache) > RAM_SLOTS:
                            victim = next(v for v in cache if v not in route.chosen)
                            del cache[victim]
                route.ram_hits, route.ram_misses = hits, misses
                if not with_true_weights:
                    route.true_weights = None
                layers.append(route)
            phase = "prefill" if t < 4 else "decode"
            event = TokenEvent(t, 100 + t, phase, layers, {"fetch": 2.0 + t % 3, "compute": 3.0, "total": 5.0 + t % 3})
            log.write_token(event)
            fold.add(event)
            events.append(event)
            if t == 10:
                log.write_knob_change(KnobChange(1, "ROUTE_M", 12, 12), t + 1)
        meters = fold.summary()
        log.write_summary({"route_kl": meters["route_kl"], "ids_match": [7, 8], "tf_nll": 0.1288})
    return events, meters


LEVER = dataclasses.replace(KnobValues(), CACHE_ROUTE=True, ROUTE_J=1, ROUTE_M=6)
OFF = KnobValues()


# --- writing and reading -------------------------------------------------------


def test_round_trip(tmp_path):
    path = tmp_path / "run.jsonl"
    events, _ = simulate_run(path, LEVER)
    log = read_session_log(path)
    assert log.damage is None
    assert log.header["format"] == FORMAT_NAME and log.header["version"] == FORMAT_VERSION
    assert log.header["model"] == MODEL
    assert log.header["knobs"]["CACHE_ROUTE"] is True and log.header["knobs"]["ROUTE_J"] == 1
    assert log.header["cache"] == {"ram_slots": RAM_SLOTS}
    assert {"platform", "cpu_count", "python", "time"} <= set(log.header["machine"])
    assert len(log.tokens) == len(events)
    for record, event in zip(log.tokens, events):
        assert (record["index"], record["token"], record["phase"]) == (event.index, event.token_id, event.phase)
        assert record["timings_ms"] == event.timings_ms
        for got, route in zip(record["layers"], event.layers):
            assert got["chosen"] == route.chosen.tolist()
            assert got["true_topk"] == route.true_topk.tolist()
            assert got["level"] == route.level.tolist()
            assert got["swapped"] == [int(s) for s in route.swapped]
            assert (got["ram_hits"], got["ram_misses"]) == (route.ram_hits, route.ram_misses)
            np.testing.assert_allclose(got["weights"], route.weights, rtol=1e-5)
    assert log.knob_changes == [{"type": "knob", "seq": 1, "name": "ROUTE_M", "old": 12, "new": 12, "at_token": 11}]
    assert log.summary["ids_match"] == [7, 8]


def test_every_record_is_flushed_as_written(tmp_path):
    path = tmp_path / "live.jsonl"
    writer = SessionLogWriter(path, model=MODEL, knobs=OFF)
    writer.write_token(TokenEvent(0, 5, "decode"))
    assert len(path.read_text().splitlines()) == 2  # header and token, before close
    writer.close()


def test_nan_is_written_as_null(tmp_path):
    path = tmp_path / "nan.jsonl"
    with SessionLogWriter(path, model=MODEL, knobs=OFF) as writer:
        writer.write_summary({"tf_nll": float("nan"), "n": np.int64(3)})
    assert read_session_log(path).summary == {"type": "summary", "tf_nll": None, "n": 3}


def test_truncated_last_line_is_read_up_to_the_damage_with_one_warning(tmp_path):
    path = tmp_path / "crash.jsonl"
    simulate_run(path, LEVER, n_tokens=12)
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    # drop the summary and cut the last token record in half, as a crash would
    path.write_bytes(b"".join(lines[:-2]) + lines[-2][: len(lines[-2]) // 2])
    with pytest.warns(SessionLogWarning, match="truncated") as record:
        log = read_session_log(path)
    assert len(record) == 1
    assert len(log.tokens) == 11 and log.summary is None and "truncated" in log.damage


def test_corrupt_line_in_the_middle_stops_reading_there(tmp_path):
    path = tmp_path / "corrupt.jsonl"
    simulate_run(path, LEVER, n_tokens=12)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[5] = b"\x00\xff{not json\n"
    path.write_bytes(b"".join(lines))
    with pytest.warns(SessionLogWarning, match="line 6 is damaged"):
        log = read_session_log(path)
    assert len(log.tokens) == 4


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "empty file"),
        (b"\x89PNG\r\n\x1a\n\x00\x00binary", "not a tierlab session log"),
        (b'{"prompt_ids": [1, 2], "full_ids": [1, 2, 3]}\n', "not a tierlab session log"),
        (json.dumps({"type": "header", "format": FORMAT_NAME, "version": 99}).encode() + b"\n", "version 99"),
        (b"x" * 3_000_000, "not a tierlab session log"),
    ],
)
def test_non_logs_give_a_one_line_format_error(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(FormatError, match=message) as info:
        read_session_log(path)
    text = str(info.value)
    assert "\n" not in text and str(path) in text


def test_records_missing_fields_give_a_format_error_not_a_traceback(tmp_path):
    path = tmp_path / "odd.jsonl"
    simulate_run(path, LEVER, n_tokens=3)
    lines = path.read_text().splitlines()
    lines[1] = json.dumps({"type": "token", "index": 0, "layers": [{"layer": 0}]})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FormatError, match="malformed"):
        summarise_log(path)


def test_missing_file_is_a_format_error(tmp_path):
    with pytest.raises(FormatError, match="cannot read"):
        read_session_log(tmp_path / "nope.jsonl")


# --- rows and tables -------------------------------------------------------------


def test_summarise_log_matches_the_run(tmp_path):
    path = tmp_path / "lever.jsonl"
    events, meters = simulate_run(path, LEVER)
    row = summarise_log(path)
    routes = [r for e in events for r in e.layers]
    hits = sum(r.ram_hits for r in routes)
    misses = sum(r.ram_misses for r in routes)
    assert row["row"] == "CACHE_ROUTE=1 ROUTE_J=1 ROUTE_M=6"
    assert row["ram_hit"] == pytest.approx(hits / (hits + misses))
    assert row["swap"] == pytest.approx(meters["swap"])
    assert row["route_agree"] == pytest.approx(meters["route_agree"])
    assert row["route_kl"] == pytest.approx(meters["route_kl"], rel=1e-4)
    assert row["vram_hit"] is None
    assert row["ids_match"] == "7/8" and row["tf_nll"] == 0.1288
    decode = [e for e in events if e.phase == "decode"]
    assert row["tok_s"] == pytest.approx(1000 / np.mean([e.timings_ms["total"] for e in decode]))
    assert row["fetch_ms"] == pytest.approx(np.mean([e.timings_ms["fetch"] for e in decode]))
    # the oracle replays the chosen experts with the header's cache size
    expected = [belady_hits(np.array([e.layers[l].chosen for e in events]), RAM_SLOTS) for l in range(N_LAYERS)]
    assert row["oracle_hit"] == pytest.approx(sum(x.hits for x in expected) / sum(x.requests for x in expected))
    lru = [lru_hits(np.array([e.layers[l].chosen for e in events]), RAM_SLOTS) for l in range(N_LAYERS)]
    assert row["ram_hit"] == pytest.approx(sum(x.hits for x in lru) / sum(x.requests for x in lru))
    assert row["oracle_hit"] >= row["ram_hit"]


def test_summarise_log_without_true_weights_takes_kl_from_the_summary(tmp_path):
    path = tmp_path / "old.jsonl"
    _, meters = simulate_run(path, LEVER, with_true_weights=False)
    assert summarise_log(path)["route_kl"] == pytest.approx(meters["route_kl"])


def test_summary_figures_may_sit_under_meters(tmp_path):
    path = tmp_path / "app.jsonl"
    with SessionLogWriter(path, model=MODEL, knobs=OFF) as writer:
        writer.write_summary({"meters": {"tf_nll": 0.2, "ids_match": "3/4"}, "tokens": 0})
    row = summarise_log(path)
    assert (row["tf_nll"], row["ids_match"], row["ram_hit"], row["tok_s"]) == (0.2, "3/4", None, None)


def test_lever_off_rows_show_no_routing_figures(tmp_path):
    path = tmp_path / "off.jsonl"
    simulate_run(path, OFF)
    row = summarise_log(path)
    assert row["row"] == "lever off"
    assert row["swap"] is None and row["route_agree"] is None and row["route_kl"] is None
    assert row["ram_hit"] is not None


def test_repeats_give_a_timing_band(tmp_path):
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"r{i}.jsonl")
        simulate_run(paths[-1], LEVER, seed=0)
    row = summarise_logs(paths)
    assert len(row["tok_s"]) == 3
    row["tok_s"] = [4.81, 4.90, 5.02]
    text = render_text([row])
    assert "4.90 (4.81–5.02)" in text


def test_render_text_and_markdown():
    rows = [
        {"row": "lever off", "tok_s": 4.6, "fetch_ms": 26.3, "compute_ms": 28.0, "ram_hit": 0.768,
         "ids_match": "128/128", "tf_nll": 0.1288},
        {"row": "CACHE_ROUTE=1", "tok_s": [4.8, 4.9, 5.0], "ram_hit": 0.853, "swap": 0.106, "route_agree": 0.894,
         "route_kl": 1.85, "ids_match": "54/128", "tf_nll": 0.1606},
    ]
    text = render_text(rows).splitlines()
    assert text[0].split("  ")[0].strip() == "row"
    for title in ("tok/s", "fetch ms/tok", "compute ms/tok", "RAM hit", "VRAM hit", "oracle hit", "swap",
                  "agree", "KL", "ids match", "TF-NLL"):
        assert title in text[0]
    assert len({len(line) for line in text}) <= len(text)  # aligned: right edges line up
    assert text[1].startswith("lever off") and "76.8%" in text[1] and "–" in text[1]
    assert "4.90 (4.80–5.00)" in text[2] and "10.6%" in text[2] and "89.4%" in text[2] and "1.85" in text[2]
    md = render_markdown(rows).splitlines()
    assert md[0].startswith("| row | tok/s |") and md[1].startswith("|---|---:|")
    assert md[3].startswith("| CACHE_ROUTE=1 |")


def test_knob_label():
    assert knob_label(OFF.as_dict()) == "lever off"
    assert knob_label(dataclasses.replace(OFF, CACHE_ROUTE=True, ROUTE_P=0.5).as_dict()) == "CACHE_ROUTE=1 ROUTE_P=0.5"


# --- the compare command ----------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(PYTHON), "-m", "tierlab", "compare", *args], capture_output=True, text=True, timeout=120
    )


def test_compare_prints_the_table_for_two_logs(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    simulate_run(a, OFF)
    simulate_run(b, LEVER)
    done = run_cli(str(a), str(b))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3 and "RAM hit" in lines[0] and "oracle hit" in lines[0]
    assert lines[1].startswith("lever off") and lines[2].startswith("CACHE_ROUTE=1 ROUTE_J=1 ROUTE_M=6")
    done = run_cli(str(a), f"{b},{b}", "--markdown")
    assert done.returncode == 0, done.stderr
    assert all(line.startswith("|") for line in done.stdout.splitlines())


def test_compare_bad_file_exits_2_with_one_line(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    simulate_run(good, OFF, n_tokens=5)
    bad.write_bytes(b"\x00\x01 definitely not a log")
    done = run_cli(str(good), str(bad))
    assert done.returncode == 2
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and str(bad) in done.stderr


def test_compare_reads_a_truncated_log_with_a_warning_line(tmp_path):
    path = tmp_path / "cut.jsonl"
    simulate_run(path, LEVER, n_tokens=8)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    done = run_cli(str(path))
    assert done.returncode == 0
    assert done.stderr.count("\n") == 1 and "warning" in done.stderr and "Traceback" not in done.stderr
