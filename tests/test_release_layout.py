"""The Qwen3.6-35B-A3B release's folder, tiny, end to end: the vision-language class, bf16,
fused experts, `model.language_model.`, `mtp.*` and `model.visual.*` present and ignored,
text_config nested, tokenizer and chat template — tierlab loads it and matches transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

import oracle_models as om
from conftest import run_cli
from qwen_template import THINKING_TEMPLATE
from test_engine_oracle import PROMPT, REL, rel_err
from tierlab.engine.conversation import Conversation
from tierlab.engine.model import load_engine
from tierlab.engine.options import default_model
from tierlab.engine.safetensors_file import read_header


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(transformers' model loaded back from the folder in float32, the folder)."""
    import torch
    from transformers import Qwen3_5MoeForConditionalGeneration

    folder = tmp_path_factory.mktemp("release") / "Qwen3.6-tiny"
    vocab = om.release_tokenizer(default_model(), folder)
    model = om.build_release_model(vocab)
    om.write_release(model, folder, default_model(), THINKING_TEMPLATE)
    oracle = Qwen3_5MoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return oracle, folder


def _logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits[0].float().numpy()


def test_the_folder_has_the_release_layout(release):
    _, folder = release
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and config["model_type"] == "qwen3_5_moe"
    assert config["text_config"]["num_experts"] == 8 and "vision_config" in config
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2
    entries = {}
    for shard in set(index.values()):
        entries.update(read_header(folder / shard))
    assert {e.dtype for e in entries.values()} == {"BF16"}
    gate_up = entries["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape
    assert gate_up == (8, 128, 64) and entries["model.language_model.layers.0.mlp.experts.down_proj"].shape == (8, 64, 64)
    assert any(n.startswith("mtp.") for n in entries) and any(n.startswith("model.visual.") for n in entries)
    assert "lm_head.weight" in entries and not any(".experts.0." in n for n in entries)


def test_tierlab_matches_transformers_on_the_release_folder(release):
    oracle, folder = release
    engine = load_engine(folder)
    assert engine.config.is_vl and engine.ckpt.fused_experts and engine.ckpt.prefix == "model.language_model."
    stored = [info.name for info in engine.ckpt.tensors.values()]
    assert stored and not any(n.startswith(("mtp.", "model.visual.")) for n in stored)
    full = list(PROMPT)
    ref = _logits(oracle, full)
    assert rel_err(engine.prefill(full, all_logits=True), ref) < REL
    logits = engine.prefill(full)
    for _ in range(8):  # greedy decode, each step against transformers on the whole sequence
        token = int(np.argmax(logits))
        full.append(token)
        logits = engine.step(token)
        assert rel_err(logits, _logits(oracle, full)[-1]) < REL
    engine.close()


def test_a_chat_on_the_release_folder_matches_transformers(release):
    """Through its tokenizer and chat template, two turns, the second reusing the first's state."""
    oracle, folder = release
    engine = load_engine(folder)
    tok = engine.tokenizer
    assert tok.thinking_default() is True
    conversation = Conversation(engine)
    messages = [{"role": "user", "content": "Name a colour."}]
    first = tok.encode(tok.render_chat(messages, enable_thinking=False))
    reply = [t for t in engine.generate(first, max_new_tokens=6, conversation=conversation)
             if t not in engine.eos_ids()]
    messages += [{"role": "assistant", "content": tok.decode(reply)}, {"role": "user", "content": "Another."}]
    ids = tok.encode(tok.render_chat(messages, enable_thinking=False))
    logits = conversation.prefill(ids)
    # the history drops the empty <think></think>: the state resumes from the snapshot before it
    (tail,) = tok.dropped_tails()
    assert tok.decode(tail) == "<think>\n\n</think>\n\n" and conversation.reused == len(first) - len(tail)
    assert rel_err(logits, _logits(oracle, ids)[-1]) < REL
    engine.close()


def test_generate_runs_on_the_release_folder(release):
    _, folder = release
    r = run_cli("generate", "--model", str(folder), "--prompt", "hi", "--chat", "--thinking", "off", "-n", "4",
                "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["ids"]) >= 1


def test_the_release_folder_converts_to_a_container(release, tmp_path):
    """`convert` as docs/real-model.md gives it; the container keeps the tokenizer and template."""
    oracle, folder = release
    out = tmp_path / "q8"
    r = run_cli("convert", "--model", str(folder), "--out", str(out), "--bits", "8", "--dense-bits", "8")
    assert r.returncode == 0, r.stderr
    engine = load_engine(out)
    assert engine.tokenizer.thinking_default() is True and engine.tokenizer.dropped_tails()
    # int8 moves a few near-tied routings on so tiny a model, so the mean error is what is bounded
    got, want = engine.prefill(PROMPT, all_logits=True), _logits(oracle, PROMPT)
    assert np.abs(got - want).mean() < 0.15 * np.abs(want).mean()
    engine.close()
