"""A/B rows and session logs from real engine runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli
from tierlab.app.lab.ab import parse_row, run_ab
from tierlab.engine.errors import TierlabError
from tierlab.engine.sessionlog import read_session_log

PROMPT = [int(i) for i in np.random.default_rng(9).integers(2, 250, 10)]


@pytest.fixture(scope="module")
def ref(oracle_models, tmp_path_factory):
    import oracle_models as om

    model, folder = oracle_models["qwen3_5_moe"]
    path = tmp_path_factory.mktemp("ab") / "ref.json"
    path.write_text(json.dumps({"prompt_ids": PROMPT, "full_ids": om.hf_greedy(model, PROMPT, 12)}))
    return folder, path


def test_rows_reproduce_the_seed_shape(ref):
    folder, path = ref
    data = json.loads(path.read_text())
    results = run_ab(folder, data["prompt_ids"], data["full_ids"],
                     ["off", "CACHE_ROUTE=1", "CACHE_ROUTE=1 ROUTE_J=1", "CACHE_ROUTE=1 ROUTE_J=0"],
                     repeat=1, default_engine={"CACHE": "4"})
    rows = [r.as_row() for r in results]
    off, default, j1, j0 = rows
    assert off["ids_match"] == "12/12" and off["swap"] is None
    # top-2 model: the default J=2 substitutes nothing and changes nothing
    assert default["swap"] == 0.0 and default["ids_match"] == "12/12" and default["tf_nll"] == off["tf_nll"]
    # lowering J trades agreement for hits
    assert off["ram_hit"] < j1["ram_hit"] < j0["ram_hit"]
    assert 1.0 > j1["route_agree"] > j0["route_agree"]
    assert j0["tf_nll"] > off["tf_nll"]
    assert all(len(r["tok_s"]) == 1 and r["tok_s"][0] > 0 for r in rows)


def test_rows_are_deterministic_across_runs(ref):
    folder, path = ref
    data = json.loads(path.read_text())
    a = run_ab(folder, data["prompt_ids"], data["full_ids"], ["CACHE_ROUTE=1 ROUTE_J=1"], repeat=0,
               default_engine={"CACHE": "3"}, tf_nll=False)[0]
    b = run_ab(folder, data["prompt_ids"], data["full_ids"], ["CACHE_ROUTE=1 ROUTE_J=1"], repeat=0,
               default_engine={"CACHE": "3"}, tf_nll=False)[0]
    assert a.meters["ram_hit"] == b.meters["ram_hit"] and a.matching == b.matching


def test_parse_row_rejects_unknown_settings():
    with pytest.raises(TierlabError):
        parse_row("CACHE_ROUTE=1 BOGUS=2", {})
    with pytest.raises(TierlabError):
        parse_row("ROUTE_J", {})
    spec = parse_row("CACHE_ROUTE=1 ROUTE_J=4 CACHE=8", {})
    assert spec.knobs.ROUTE_J == 4 and dict(spec.engine) == {"CACHE": "8"}


def test_ab_cli_markdown(ref):
    folder, path = ref
    proc = run_cli("ab", "--model", str(folder), "--ref", str(path), "--cache", "4", "--repeat", "1",
                   "--row", "off", "--row", "CACHE_ROUTE=1 ROUTE_J=1", "--markdown")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(lines) == 4 and "RAM hit" in lines[0] and "CACHE_ROUTE=1 ROUTE_J=1" in lines[3]


def test_eval_log_then_compare(ref, tmp_path):
    folder, path = ref
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert run_cli("eval", "--model", str(folder), "--ref", str(path), "--cache", "4", "--ppl",
                   "--log", str(a)).returncode == 0
    run_cli("eval", "--model", str(folder), "--ref", str(path), "--cache", "4", "--ppl", "--log", str(b),
            env={"CACHE_ROUTE": "1", "ROUTE_J": "1"})
    log = read_session_log(b)
    assert log.damage is None
    assert len(log.tokens) == len(PROMPT) + 11  # prefill + decode steps of the generation only
    assert log.summary["ids_match"].endswith("/12") and log.summary["tf_nll"] > 0
    proc = run_cli("compare", str(a), str(b))
    assert proc.returncode == 0, proc.stderr
    assert "12/12" in proc.stdout
