"""`tierlab replay`: a real session log of the shipped 8x2 model, re-run under rows, paired."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, run_cli
from tierlab.app.lab.bootstrap import paired_bootstrap
from tierlab.app.lab.evaluate import read_ref, run_eval
from tierlab.app.lab.gates import Gates
from tierlab.app.lab.knob_script import KnobStep
from tierlab.app.lab.replay import check_model, read_recording, run_replay
from tierlab.engine.errors import FormatError, TierlabError
from tierlab.engine.options import EngineOptions
from tierlab.engine.session import EngineLog

MODEL = REPO / "assets" / "tiny-moe-8x2"
CACHE = 3
LEVER = "CACHE_ROUTE=1 ROUTE_J=1"


def record(path: Path, steps: list[KnobStep] | None = None, n_tokens: int = 24) -> Path:
    """An `eval --log` session, in process: the generation recorded, its stream at the end."""
    prompt, full = read_ref(MODEL / "ref.json")
    full = full[: len(prompt) + n_tokens]
    engine = EngineOptions(MODEL, CACHE, knobs_from_env=False).open(with_tokenizer=False)
    try:
        log = EngineLog(engine, path)
        result = run_eval(engine, prompt, full, steps=steps, on_generated=log.detach)
        log.close({"ids_match": f"{result['matching']}/{result['total']}"}, stream=(prompt, result["generated"]))
    finally:
        engine.close()
    return path


@pytest.fixture(scope="module")
def lever_off_log(tmp_path_factory) -> Path:
    return record(tmp_path_factory.mktemp("replay") / "off.jsonl")


@pytest.fixture(scope="module")
def replayed(lever_off_log):
    recording = read_recording(lever_off_log)
    rows = run_replay(recording, check_model(recording, None), ["off", LEVER], resamples=500)
    return recording, rows


def test_the_lever_off_row_of_a_lever_off_log_is_exactly_the_recording(replayed):
    recording, (base, off, _) = replayed
    m = off.metrics
    assert m["dnll"] == 0.0 and m["dnll_lo"] == 0.0 and m["dnll_hi"] == 0.0
    assert m["kl_mean"] == 0.0 and m["kl_p50"] == 0.0 and m["kl_p99"] == 0.0
    assert m["agree"] == 1.0 and m["flips"] == 0.0 and m["dram_hit"] == 0.0
    assert m["diverge"] is None and off.generated == base.generated == recording.generated
    assert off.verdict.passed and base.verdict.passed
    assert m["tokens"] == len(recording.generated)


def test_the_lever_raises_the_hit_rate_and_moves_the_distribution(replayed):
    _, (base, _, lever) = replayed
    m = lever.metrics
    assert m["ram_hit"] > base.metrics["ram_hit"] and m["dram_hit"] > 0
    assert m["kl_mean"] > 0 and m["kl_p99"] >= m["kl_p50"] >= 0
    assert 0 < m["agree"] < 1
    assert m["dnll_lo"] <= m["dnll"] <= m["dnll_hi"]
    assert m["diverge"] is not None and 0 <= m["diverge"] < len(base.generated)
    # the lever fails the default gates, and each gate it fails is one whose figure is past its limit
    gates = Gates()
    past = {"dnll_hi": m["dnll_hi"] > gates.dnll, "agree": m["agree"] < gates.agree,
            "kl_p99": m["kl_p99"] > gates.kl99, "flips": m["flips"] > gates.flips}
    assert not lever.verdict.passed
    assert set(lever.verdict.failed) == {key for key, over in past.items() if over}


def test_recorded_knob_changes_are_replayed_where_they_were_made(tmp_path):
    steps = [KnobStep(6, (("CACHE_ROUTE", True), ("ROUTE_J", 1)))]
    recording = read_recording(record(tmp_path / "scripted.jsonl", steps))
    assert [s.at for s in recording.steps] == [6, 6]
    (base,) = run_replay(recording, check_model(recording, None), [], resamples=200)
    # the baseline's free generation under the recorded changes is the recorded generation
    assert base.generated == recording.generated


def test_bootstrap_intervals_cover_the_true_mean():
    covered = 0
    trials = 300
    for seed in range(trials):
        sample = np.random.default_rng(1000 + seed).normal(0.3, 1.0, size=120)
        _, low, high = paired_bootstrap(sample, resamples=1000, seed=seed)
        covered += low <= 0.3 <= high
    assert 0.91 <= covered / trials <= 0.98
    assert paired_bootstrap(np.zeros(50)) == (0.0, 0.0, 0.0)


def one_line_exit_2(done) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0
    return done.stderr


def test_a_truncated_log_is_refused(lever_off_log, tmp_path):
    cut = tmp_path / "cut.jsonl"
    data = lever_off_log.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    assert "replay needs a whole log" in one_line_exit_2(run_cli("replay", str(cut)))
    with pytest.raises(FormatError):
        read_recording(cut)


def test_a_foreign_file_is_refused(tmp_path):
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text('{"hello": "world"}\n')
    assert "not a tierlab session log" in one_line_exit_2(run_cli("replay", str(foreign)))


def test_a_log_of_another_model_is_refused(lever_off_log):
    err = one_line_exit_2(run_cli("replay", str(lever_off_log), "--model", str(REPO / "assets" / "tiny-moe")))
    assert "replay refuses another model" in err
    with pytest.raises(TierlabError, match="another model"):
        check_model(read_recording(lever_off_log), REPO / "assets" / "tiny-moe")


def test_an_unknown_knob_in_a_row_is_refused(lever_off_log):
    assert "BOGUS" in one_line_exit_2(run_cli("replay", str(lever_off_log), "--row", "CACHE_ROUTE=1 BOGUS=3"))


def test_a_version_1_log_replays_with_a_warning(lever_off_log, tmp_path):
    lines = [json.loads(line) for line in lever_off_log.read_text().splitlines()]
    header = {k: v for k, v in lines[0].items() if k not in ("fingerprint", "sampling", "tier")}
    old = [{**header, "version": 1}] + [r for r in lines[1:] if r["type"] != "stream"]
    path = tmp_path / "v1.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    done = run_cli("replay", str(path), "--row", "off", "--no-generate", "--json")
    assert done.returncode == 0, done.stderr
    assert "warning" in done.stderr and "fingerprint" in done.stderr
    rows = json.loads(done.stdout)["rows"]
    # without the stream record the last generated token was never fed: one token fewer
    stream = next(r for r in lines if r["type"] == "stream")
    assert rows[1]["tokens"] == len(stream["generated_ids"]) - 1
    assert rows[1]["dnll"] == 0.0 and rows[1]["agree"] == 1.0


def test_the_cli_prints_the_table_csv_and_markdown(lever_off_log):
    done = run_cli("replay", str(lever_off_log), "--row", "off", "--no-generate", "--csv", "--resamples", "200")
    assert done.returncode == 0, done.stderr
    header, base, off = done.stdout.splitlines()
    assert header.startswith("row,tokens,nll,ram_hit,dram_hit") and base.startswith("recorded (lever off),")
    assert off.split(",")[0] == "off" and off.endswith(",pass")
    done = run_cli("replay", str(lever_off_log), "--row", LEVER, "--no-generate", "--md", "--gate-agree", "0")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("| row | RAM hit | ΔRAM hit |") and len(lines) == 4


def test_paired_figures_on_known_distributions():
    from tierlab.app.lab.paired import Trace, paired_metrics, repeated_4grams

    def trace(probs, targets):
        lp = np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)
        nll = -lp[np.arange(len(targets)), targets].astype(np.float64)
        return Trace(lp, nll, lp.argmax(axis=1), float(nll.mean()), {"ram_hit": 0.5, "vram_hit": None})

    targets = [0, 1]
    base = trace([[0.9, 0.1], [0.4, 0.6]], targets)
    row = trace([[0.3, 0.7], [0.4, 0.6]], targets)
    m = paired_metrics(base, row, resamples=200)
    expected_kl = 0.9 * np.log(0.9 / 0.3) + 0.1 * np.log(0.1 / 0.7)
    assert m["kl_mean"] == pytest.approx(expected_kl / 2, rel=1e-5)
    assert m["agree"] == 0.5 and m["flips"] == 0.5 and m["flips_n"] == 1 and m["confident_n"] == 2
    assert m["dnll"] == pytest.approx((np.log(0.9 / 0.3)) / 2, rel=1e-5)
    assert m["dram_hit"] == 0.0 and m["dvram_hit"] is None
    assert repeated_4grams([1, 2, 3, 4, 1, 2, 3, 4]) == 0.2 and repeated_4grams([1, 2]) is None
