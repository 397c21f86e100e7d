"""A chat turn that reuses the sequence state gives what a full re-prefill of the conversation gives."""

from __future__ import annotations

import numpy as np
import pytest

from tierlab.engine.conversation import Conversation
from tierlab.engine.model import load_engine
from tierlab.engine.options import default_model

REPO_MODELS = {"tiny-moe": "tiny-moe", "tiny-moe-8x2": "tiny-moe-8x2"}
TOL = 1e-5


def _folder(name, oracle_models):
    if name in REPO_MODELS:
        return default_model().parent / REPO_MODELS[name]
    return oracle_models[name][1]


MODELS = ["tiny-moe", "tiny-moe-8x2", "qwen3_5_moe", "qwen3_moe"]


def _user(rng, vocab, n):
    return [int(i) for i in rng.integers(3, min(vocab, 250), n)]


def _greedy(conv_or_engine, prompt, n):
    return list(conv_or_engine.generate(prompt, max_new_tokens=n, eos_ids=[]))


def _close(a, b) -> float:
    return float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("name", MODELS)
def test_turn_three_logits_equal_a_full_reprefill(oracle_models, name):
    engine = load_engine(_folder(name, oracle_models), warmup=False)
    full = load_engine(_folder(name, oracle_models), warmup=False)
    vocab = engine.config.vocab_size
    rng = np.random.default_rng(3)
    conv = Conversation(engine)
    prompt = _user(rng, vocab, 12)
    for turn in range(2):
        reply = _greedy(conv, prompt, 6)
        prompt = prompt + reply + _user(rng, vocab, 5 + turn)
    logits = conv.prefill(prompt)
    assert conv.reused == len(prompt) - 6 and conv.prefilled == 6  # the reply's last token and the new turn
    assert _close(logits, full.prefill(prompt)) < TOL
    # the decode that follows agrees too
    step = int(np.argmax(logits))
    assert _close(engine.step(step), full.step(step)) < TOL
    engine.close()
    full.close()


@pytest.mark.parametrize("name", ["tiny-moe", "qwen3_5_moe", "qwen3_moe"])
def test_a_rerendered_turn_resumes_at_the_latest_snapshot(oracle_models, name):
    """A template that renders a past reply differently (Qwen3 drops its thinking): the
    state goes back to the prompt end before that reply (DeltaNet) or to the common
    prefix (attention only), and the logits still equal a full prefill."""
    engine = load_engine(_folder(name, oracle_models), warmup=False)
    vocab = engine.config.vocab_size
    rng = np.random.default_rng(5)
    conv = Conversation(engine)
    first = _user(rng, vocab, 10)
    reply = _greedy(conv, first, 8)
    shown = reply[3:]  # the history shows the reply without its first tokens
    prompt = first + shown + _user(rng, vocab, 4)
    common = 10 + next((i for i, (a, b) in enumerate(zip(shown, reply)) if a != b), min(len(shown), len(reply)))
    logits = conv.prefill(prompt)
    assert conv.reused == (common if engine.rewinds_anywhere() else 10)
    assert _close(logits, load_engine(_folder(name, oracle_models), warmup=False).prefill(prompt)) < TOL
    engine.close()


def test_three_turn_greedy_chat_ids_equal_the_reprefill_path():
    folder = default_model()
    reuse, full = load_engine(folder), load_engine(folder)
    tok = reuse.tokenizer
    conv = Conversation(reuse)
    messages: list[dict] = []
    reused = []
    for text in ("Once upon a time", "What happened next?", "And then?"):
        messages.append({"role": "user", "content": text})
        ids = tok.encode(tok.render_chat(messages))
        got = list(conv.generate(ids, max_new_tokens=24))
        want = list(full.generate(ids, max_new_tokens=24))
        assert got == want and got
        reused.append(conv.reused)
        eos = set(reuse.eos_ids())
        messages.append({"role": "assistant", "content": tok.decode([t for t in got if t not in eos])})
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > reused[1]
    reuse.close()
    full.close()


def test_clearing_or_a_reset_means_a_full_prefill():
    engine = load_engine(default_model(), warmup=False)
    conv = Conversation(engine)
    prompt = list(range(5, 25))
    _greedy(conv, prompt, 4)
    assert conv.snapshots and all(engine.can_restore(s) for s in conv.snapshots)
    conv.prefill(prompt + [30, 31])
    assert conv.reused > 0
    conv.forget()
    conv.prefill(prompt + [30, 31])
    assert conv.reused == 0
    stale = conv.snapshots[-1]
    engine.reset()  # someone else started a sequence: old snapshots no longer restore
    assert not engine.can_restore(stale)
    with pytest.raises(ValueError):
        engine.restore_state(stale)
    conv.prefill(prompt)
    assert conv.reused == 0
    engine.close()


def test_a_snapshot_of_another_branch_does_not_restore():
    engine = load_engine(default_model(), warmup=False)
    engine.prefill([5, 6])
    at_two = engine.save_state()
    engine.forward([7, 8])
    at_four = engine.save_state()
    engine.restore_state(at_two)
    engine.forward([9, 10])
    assert engine.sequence_ids() == [5, 6, 9, 10]
    assert engine.can_restore(at_two) and not engine.can_restore(at_four)
    engine.close()


def test_the_chat_command_reuses_and_answers_as_a_reprefill_does():
    import re
    import subprocess

    from conftest import PYTHON

    turns = "Once upon a time\nWhat happened next?\nAnd then?\n"
    runs = [subprocess.run([PYTHON, "-m", "tierlab", "chat", "-n", "12", "--stats", *extra], input=turns,
                           capture_output=True, text=True, timeout=300) for extra in ([], ["--reprefill"])]
    for r in runs:
        assert r.returncode == 0, r.stderr
    reuse, full = runs
    assert reuse.stdout == full.stdout and reuse.stdout.strip()
    kept = [int(k) for k in re.findall(r"reused (\d+)", reuse.stderr)]
    assert len(kept) == 3 and kept[0] == 0 and kept[1] > 0 and kept[2] > kept[1]
    assert re.findall(r"reused (\d+)", full.stderr) == ["0", "0", "0"]
