"""The engine against transformers (float32) on tiny random checkpoints of both architectures."""

from __future__ import annotations

import json

import numpy as np
import pytest

import oracle_models as om
from conftest import run_cli
from tierlab.app.lab.evaluate import run_eval, teacher_forced_nll
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine

NAMES = ["qwen3_5_moe", "qwen3_moe", "qwen3_5_moe_fused_vl"]
PROMPT = [int(i) for i in np.random.default_rng(7).integers(2, 250, 24)]
REL = 1e-4


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


@pytest.fixture(scope="module")
def references(oracle_models):
    """Per model: transformers' logits of the prompt and its 16-step greedy continuation."""
    out = {}
    for name, (model, _) in oracle_models.items():
        full = om.hf_greedy(model, PROMPT, 16)
        out[name] = (full, om.hf_logits(model, full))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logits_match_transformers(oracle_models, references, name):
    _, folder = oracle_models[name]
    full, ref_logits = references[name]
    engine = load_engine(folder)
    logits = engine.prefill(PROMPT, all_logits=True)
    assert logits.shape == (24, engine.config.vocab_size)
    assert rel_err(logits, ref_logits[:24]) < REL


@pytest.mark.parametrize("name", NAMES)
def test_decode_steps_match_transformers(oracle_models, references, name):
    _, folder = oracle_models[name]
    full, ref_logits = references[name]
    engine = load_engine(folder)
    logits = engine.prefill(PROMPT)
    assert rel_err(logits, ref_logits[23]) < REL
    for i in range(24, len(full)):
        assert int(np.argmax(logits)) == full[i]
        logits = engine.step(full[i])
        assert rel_err(logits, ref_logits[i]) < REL


@pytest.mark.parametrize("name", NAMES)
def test_fast_prompt_kernels_agree_with_the_exact_ones(oracle_models, references, name):
    """A prompt's default kernels (DeltaNet by blocks of state columns, attention as blocked
    products, grouped experts) and PREFILL_EXACT's (decode's arithmetic): every position's logits
    within float32 noise of each other and within REL of transformers, the same greedy tokens."""
    _, folder = oracle_models[name]
    full, ref_logits = references[name]
    fast = load_engine(folder, knobs=Knobs.from_env({})).prefill(full, all_logits=True)
    exact = load_engine(folder, knobs=Knobs.from_env(PREFILL_EXACT="1")).prefill(full, all_logits=True)
    assert rel_err(fast, exact) < 1e-5
    assert rel_err(fast, ref_logits) < REL and rel_err(exact, ref_logits) < REL
    assert np.array_equal(fast.argmax(1), exact.argmax(1))


def test_fused_layout_is_detected(oracle_models):
    engine = load_engine(oracle_models["qwen3_5_moe_fused_vl"][1])
    assert engine.ckpt.fused_experts and engine.ckpt.prefix == "model.language_model."
    assert engine.config.is_vl
    plain = load_engine(oracle_models["qwen3_5_moe"][1])
    assert not plain.ckpt.fused_experts and plain.ckpt.prefix == "model."


@pytest.mark.parametrize("name", NAMES)
def test_tf_nll_matches_transformers(oracle_models, references, name):
    _, folder = oracle_models[name]
    full, ref_logits = references[name]
    z = ref_logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    positions = range(len(PROMPT) - 1, len(full) - 1)
    expected = float(np.mean([lse[p] - z[p, full[p + 1]] for p in positions]))
    nll, n = teacher_forced_nll(load_engine(folder), PROMPT, full)
    assert n == 16
    assert abs(nll - expected) <= 1e-4 * max(1.0, abs(expected))


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_moe"])
def test_results_identical_for_every_cache_size(oracle_models, references, name):
    """With PREFILL_EXACT a prompt's grouped experts (every expert has a slot) give the bits of
    the token-by-token path that smaller caches take."""
    _, folder = oracle_models[name]
    full, _ = references[name]
    results = {}
    for slots in (1, 2, None):
        engine = load_engine(folder, cache_slots=slots, knobs=Knobs.from_env(PREFILL_EXACT="1"))
        r = run_eval(engine, PROMPT, full, ppl=True)
        results[slots] = r
        assert r["matching"] == r["total"] == 16
        if slots is None:
            assert r["ram_misses"] <= engine.config.n_experts * engine.config.n_layers
    assert results[1]["generated"] == results[2]["generated"] == results[None]["generated"]
    assert results[1]["tf_nll"] == results[2]["tf_nll"] == results[None]["tf_nll"]
    # smaller caches miss more, and the Belady bound is never below LRU
    assert results[1]["ram_hit"] <= results[2]["ram_hit"] <= results[None]["ram_hit"]
    for r in results.values():
        assert r["oracle_hit"] >= r["ram_hit"] - 1e-9


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_moe"])
def test_grouped_prefill_agrees_with_token_by_token_within_float_noise(oracle_models, references, name):
    """By default a prompt's grouped experts use matrix-matrix products: the same greedy tokens
    and a TF-NLL within 1e-6 of the token-by-token path a one-slot cache takes."""
    _, folder = oracle_models[name]
    full, _ = references[name]
    fast = run_eval(load_engine(folder, knobs=Knobs.from_env({})), PROMPT, full, ppl=True)
    alone = run_eval(load_engine(folder, cache_slots=1, knobs=Knobs.from_env({})), PROMPT, full, ppl=True)
    assert fast["generated"] == alone["generated"]
    assert abs(fast["tf_nll"] - alone["tf_nll"]) <= 1e-6 * max(1.0, abs(alone["tf_nll"]))


def test_eval_cli_reports_all_tokens_matching(oracle_models, references, tmp_path):
    _, folder = oracle_models["qwen3_5_moe"]
    full, _ = references["qwen3_5_moe"]
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"prompt_ids": PROMPT, "full_ids": full}))
    proc = run_cli("eval", "--model", str(folder), "--ref", str(ref), "--ppl", "--cache", "2")
    assert proc.returncode == 0, proc.stderr
    assert "Matching tokens: 16/16" in proc.stdout
    assert "TF-NLL: " in proc.stdout and "Expert cache hit rate: " in proc.stdout
    proc = run_cli("eval", "--model", str(folder), "--ref", str(ref), "--json")
    data = json.loads(proc.stdout)
    for key in ("matching", "total", "tf_nll", "ppl", "ram_hit", "tok_s", "fetch_ms", "compute_ms", "oracle_hit"):
        assert key in data
    assert data["matching"] == data["total"] == 16


def test_ref_cli_writes_greedy_continuation(oracle_models, references, tmp_path):
    _, folder = oracle_models["qwen3_moe"]
    full, _ = references["qwen3_moe"]
    out = tmp_path / "ref.json"
    proc = run_cli("ref", "--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)), "-n", "16", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data == {"prompt_ids": PROMPT, "full_ids": full}


def test_eval_exits_nonzero_on_mismatch(oracle_models, references, tmp_path):
    _, folder = oracle_models["qwen3_moe"]
    full, _ = references["qwen3_moe"]
    wrong = list(full)
    wrong[-1] = (wrong[-1] + 1) % 256
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"prompt_ids": PROMPT, "full_ids": wrong}))
    proc = run_cli("eval", "--model", str(folder), "--ref", str(ref))
    assert proc.returncode == 1
    assert "Matching tokens: 15/16" in proc.stdout
