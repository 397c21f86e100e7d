"""`--knobs-at`: scripted knob changes on generate, eval and ab, and the segments they cut a run into."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli
from tierlab import ASSETS_DIR
from tierlab.app.lab.knob_script import parse_knobs_at
from tierlab.engine.errors import TierlabError
from tierlab.engine.knobs import Knobs
from tierlab.engine.meters import MeterFold
from tierlab.engine.model import load_engine
from tierlab.engine.sessionlog import read_session_log

MODEL = ASSETS_DIR / "tiny-moe"
REF_PATH = MODEL / "ref.json"
REF = json.loads(REF_PATH.read_text())
T = 8
LEVER = {"CACHE_ROUTE": True, "ROUTE_J": 1}
ROUTING_KEYS = ("ram_hits", "ram_misses", "shadow_hits", "shadow_misses", "decisions", "slots", "swaps",
                "agree_hit", "agree_tot", "kl_count", "kl_sum")


def test_a_step_is_parsed_and_checked():
    step = parse_knobs_at("8:CACHE_ROUTE=1,ROUTE_J=1,CACHE=4")
    assert step.at == 8 and step.settings == (("CACHE_ROUTE", True), ("ROUTE_J", 1), ("CACHE", 4))
    for bad, why in [("3", "expected T:KEY=V"), ("x:ROUTE_J=1", "whole number"), ("-1:ROUTE_J=1", "whole number"),
                     ("3:NOPE=1", "unknown knob NOPE"), ("3:ROUTE_J=-1", "below"), ("3:ROUTE_P=nan", "finite"),
                     ("3:ROUTE_J", "not KEY=V"), ("3:CACHE=0", "CACHE"), ("3:ROUTE_MODE=best", "not one of")]:
        with pytest.raises(TierlabError, match=why):
            parse_knobs_at(bad)


@pytest.mark.parametrize("command,spec", [("eval", "3"), ("eval", "x:ROUTE_J=1"), ("generate", "3:NOPE=1"),
                                          ("ab", "3:ROUTE_J=-1"), ("eval", "3:ROUTE_P=nan")])
def test_a_bad_step_is_one_line_and_exit_2(command, spec):
    extra = {"eval": ["--ref", str(REF_PATH)], "generate": ["--prompt", "hi"],
             "ab": ["--ref", str(REF_PATH), "--row", "off"]}[command]
    proc = run_cli(command, *extra, "--knobs-at", spec)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--knobs-at" in lines[0] and spec in lines[0]


def test_eval_help_documents_the_flag():
    proc = run_cli("eval", "--help")
    assert proc.returncode == 0 and "--knobs-at" in proc.stdout and "T counts" in " ".join(proc.stdout.split())


def by_hand(engine, teacher_forced: bool) -> tuple[list, MeterFold]:
    """A run whose knobs are set through the API before the pass that predicts token T; the
    events of that run and a fold of the passes from there on."""
    prompt, full = REF["prompt_ids"], REF["full_ids"]
    n = len(full) - len(prompt)
    events = []
    engine.subscribe(events.append)
    logits = engine.prefill(prompt)
    for t in range(n - 1):  # the pass that feeds token t predicts token t + 1
        token = full[len(prompt) + t] if teacher_forced else int(np.argmax(logits))
        if t + 1 == T:
            for name, value in LEVER.items():
                engine.knobs.set(name, value)
        logits = engine.step(token)
    engine.unsubscribe(events.append)
    fold = MeterFold()
    for event in events:
        if event.phase == "decode" and event.index >= len(prompt) + T - 1:
            fold.add(event)
    return events, fold


def test_eval_segments_match_a_run_whose_knobs_were_set_by_hand(tmp_path):
    log_path = tmp_path / "run.jsonl"
    proc = run_cli("eval", "--ref", str(REF_PATH), "--cache", "8", "--ppl", "--json", "--log", str(log_path),
                   "--knobs-at", f"{T}:CACHE_ROUTE=1,ROUTE_J=1")
    assert proc.returncode in (0, 1), proc.stderr
    result = json.loads(proc.stdout)
    n = len(REF["full_ids"]) - len(REF["prompt_ids"])

    engine = load_engine(MODEL, cache_slots=8, knobs=Knobs.from_env({}), with_tokenizer=False)
    try:
        events, hand = by_hand(engine, teacher_forced=False)
        engine.cold_start()
        engine.knobs.reset()
        _, hand_tf = by_hand(engine, teacher_forced=True)
    finally:
        engine.close()

    for segments, fold in ((result["segments"], hand), (result["tf_segments"], hand_tf)):
        assert [(s["from"], s["to"]) for s in segments] == [(0, T), (T, n)]
        first, second = segments
        assert first["knobs"]["CACHE_ROUTE"] == 0 and first["meters"]["swap"] is None  # "–" with the lever off
        assert second["knobs"]["CACHE_ROUTE"] == 1 and second["knobs"]["ROUTE_J"] == 1
        assert second["set"] == {"CACHE_ROUTE": 1, "ROUTE_J": 1} and second["cache_slots"] == 8
        want = fold.summary()
        assert want["swaps"] > 0
        assert {k: second["meters"][k] for k in ROUTING_KEYS} == {k: want[k] for k in ROUTING_KEYS}
        assert second["meters"]["tokens"] == n - T
        assert second["meters"]["shadow_hit"] < second["meters"]["ram_hit"]

    # the log of the generation: the same decisions token by token, a segment per setting
    log = read_session_log(log_path)
    logged = {r["index"]: r for r in log.tokens}
    for event in events:
        record = logged[event.index]
        for route, layer in zip(event.layers, record["layers"]):
            assert layer["chosen"] == route.chosen.tolist() and layer["ram_hits"] == route.ram_hits
            assert layer["shadow"] == [route.shadow_ram_hits, route.shadow_ram_misses, route.shadow_vram]
    assert [(s["from_token"], s["knobs"]["CACHE_ROUTE"]) for s in log.segments] == [
        (0, False), (len(REF["prompt_ids"]) + T - 1, True)]
    assert log.segments[1]["meters"]["swaps"] == hand.summary()["swaps"]
    assert log.summary["meters"] == log.segments[-1]["meters"]  # the summary is the last setting's
    assert log.summary["recorded"]["tokens"] == len(log.tokens)


def test_generate_segments_and_a_cache_step(tmp_path):
    proc = run_cli("generate", "--prompt", "Once upon a time", "-n", "12", "--cache", "12", "--json",
                   "--knobs-at", "4:CACHE=6", "--knobs-at", "9:CACHE_ROUTE=1")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    segments = out["segments"]
    end = len(out["ids"])
    assert end > 9
    assert [(s["from"], s["to"], s["cache_slots"]) for s in segments] == [(0, 4, 12), (4, 9, 6), (9, end, 6)]
    assert segments[2]["knobs"]["CACHE_ROUTE"] == 1 and segments[2]["meters"]["swap"] is not None
    assert segments[1]["meters"]["ram_slots"] == 6 and segments[1]["meters"]["tokens"] == 5


def test_ab_rows_carry_their_segments():
    proc = run_cli("ab", "--ref", str(REF_PATH), "--row", "off", "--cache", "8", "--repeat", "0", "--no-tf",
                   "--json", "--knobs-at", f"{T}:ROUTE_AGREE=1")
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert [s["from"] for s in row["segments"]] == [0, T]
    assert row["segments"][0]["meters"]["route_agree"] is None
    assert row["segments"][1]["meters"]["route_agree"] == 100.0  # meters alone only measure
    assert row["shadow_hit"] == row["ram_hit"]
