"""The shipped tiny MoE models are genuine, trained Hugging Face checkpoints.

Checked with transformers in float32 (the numerical oracle): they load as
Qwen3.5/3.6 MoE, predict held-out text far better than a unigram model,
reproduce their ref.json under greedy decoding, and route as each is meant to:
tiny-moe with concentrated, sticky experts that a cache can exploit, the 8x2
fixture balanced, with less expert reuse than chance. The routing figures are
recomputed here independently of tools/model_stats.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tierlab.app.lab.belady import lru_hits

ASSETS = Path(__file__).resolve().parents[1] / "assets"
#: folder -> (experts per layer, top-k, size budget in bytes)
MODELS = {
    "tiny-moe": (32, 4, 24_000_000),
    "tiny-moe-8x2": (8, 2, 8_000_000),
}
TOTAL_BUDGET = 30_000_000
SLICE_TOKENS = 384


@pytest.fixture(scope="module", params=sorted(MODELS))
def shipped(request):
    """(folder, model in float32, tokenizers.Tokenizer, held-out slice ids) for each shipped model."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    path = ASSETS / request.param
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode((path / "heldout.txt").read_text()).ids[: SLICE_TOKENS + 1]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True, use_cache=False)
    return {"name": request.param, "path": path, "model": model, "tok": tok, "ids": ids,
            "logits": out.logits[0].double(), "router": [r.float().numpy() for r in out.router_logits]}


def test_config_is_qwen3_5_moe(shipped):
    cfg = shipped["model"].config
    experts, top_k, _ = MODELS[shipped["name"]]
    assert type(shipped["model"]).__name__ == "Qwen3_5MoeForCausalLM"
    assert cfg.model_type.startswith("qwen3_5_moe")
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (experts, top_k)
    assert {"linear_attention", "full_attention"} <= set(cfg.layer_types)
    assert cfg.hidden_size % 64 == 0 and cfg.moe_intermediate_size % 64 == 0
    assert cfg.shared_expert_intermediate_size > 0
    raw = json.loads((shipped["path"] / "config.json").read_text())
    assert raw["dtype"] == "bfloat16"


def test_heldout_nll_far_below_unigram(shipped):
    ids = shipped["ids"]
    lp = torch.log_softmax(shipped["logits"][:-1], -1)
    nll = float(-lp.gather(1, torch.tensor(ids[1:])[:, None]).mean())
    counts = np.asarray(json.loads((shipped["path"] / "unigram_counts.json").read_text())["counts"], dtype=np.float64)
    p = (counts + 1) / (counts.sum() + len(counts))
    unigram = float(-np.log(p[np.asarray(ids[1:])]).mean())
    assert unigram > 4.0  # sanity: a real unigram baseline on code
    assert nll < unigram - 1.5, (nll, unigram)
    assert nll < 0.75 * unigram, (nll, unigram)


def test_ref_reproduces_greedy(shipped):
    ref = json.loads((shipped["path"] / "ref.json").read_text())
    prompt, full = ref["prompt_ids"], ref["full_ids"]
    assert 24 <= len(prompt) <= 40 and len(full) == len(prompt) + 64
    with torch.no_grad():
        out = shipped["model"].generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64,
                                        min_new_tokens=64, eos_token_id=None, pad_token_id=None)
    assert out[0].tolist() == full


#: models trained for a balanced, decorrelated router (per-layer balance and decorrelation terms): the seed's fixture level
BALANCED = {"tiny-moe-8x2"}


def test_routing_is_concentrated_and_cacheable(shipped):
    if shipped["name"] in BALANCED:
        pytest.skip("trained for a balanced router: test_balanced_fixture_uses_every_expert")
    experts, k, _ = MODELS[shipped["name"]]
    entropies, hits = [], []
    for z in shipped["router"]:
        z = z.astype(np.float64)
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        entropies.append(float((-(p * np.log(p + 1e-30)).sum(1)).mean()))
        top = np.argsort(-z, axis=1, kind="stable")[:, :k]
        hits.append(lru_hits(top, experts // 2).hit_rate)
    assert np.mean(entropies) < 0.9 * math.log(experts), entropies
    assert np.mean(hits) > 0.6, hits


def test_balanced_fixture_uses_every_expert(shipped):
    """The 8x2 fixture: every layer spreads its top-k over all experts (usage entropy near log E), its
    router is still trained (per-token entropy below log E), consecutive tokens share experts less
    often than chance (the decorrelation term), and a half-size LRU hits near the seed fixture's level
    rather than a concentrated model's."""
    if shipped["name"] not in BALANCED:
        pytest.skip("a concentrated router: test_routing_is_concentrated_and_cacheable")
    experts, k, _ = MODELS[shipped["name"]]
    hits = []
    for z in shipped["router"]:
        z = z.astype(np.float64)
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        top = np.argsort(-z, axis=1, kind="stable")[:, :k]
        usage = np.bincount(top.ravel(), minlength=experts) / top.size
        assert usage.min() > 0.02, usage  # every expert carries a real share, even on one file's text
        assert -(usage * np.log(usage)).sum() > 0.9 * math.log(experts), usage
        assert float((-(p * np.log(p + 1e-30)).sum(1)).mean()) < math.log(experts)
        reuse = np.mean([len(set(a) & set(b)) / k for a, b in zip(top[:-1], top[1:])])
        assert reuse < k / experts, reuse
        hits.append(lru_hits(top, experts // 2).hit_rate)
    assert 0.4 < np.mean(hits) < 0.65, hits


def test_chat_template_renders_qwen_form(shipped):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(shipped["path"])
    text = tok.apply_chat_template([{"role": "user", "content": "What does json.dumps do?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    gen = json.loads((shipped["path"] / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]


def test_size_budget():
    total = 0
    for name, (_, _, budget) in MODELS.items():
        size = sum(f.stat().st_size for f in (ASSETS / name).iterdir() if f.is_file())
        assert size <= budget, (name, size)
        total += size
    assert total <= TOTAL_BUDGET, total


def test_engine_logits_match_transformers(shipped):
    from tierlab.engine.model import load_engine

    ref = json.loads((shipped["path"] / "ref.json").read_text())
    ids = ref["full_ids"]
    eng = load_engine(shipped["path"])
    got = np.asarray(eng.prefill(ids, all_logits=True), dtype=np.float64)
    with torch.no_grad():
        want = shipped["model"](input_ids=torch.tensor([ids]), use_cache=False).logits[0].double().numpy()
    assert got.shape == want.shape
    err = np.abs(got - want).max()
    assert err <= 1e-4 * np.abs(want).max() + 1e-4, err
    assert (got.argmax(-1) == want.argmax(-1)).all()
