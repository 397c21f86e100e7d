"""The terminal app on a real engine: a tiny random Qwen3-MoE built here, byte-level tokenizer, ChatML template."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from textual.widgets import DataTable, Input, Select, Switch

from tierlab.app.tui.chat import ChatMessage, ChatPane
from tierlab.app.tui.heat_screen import HeatInspector, ProfilePane
from tierlab.app.tui.help_screen import HelpScreen
from tierlab.app.tui.knob_panel import CACHE_SLOTS, knob_id
from tierlab.app.tui.sessions_screen import SessionsScreen
from tierlab.app.tui.app import TierlabApp
from tierlab.engine.options import EngineOptions
from tierlab.engine.tiering import TierOptions
from tierlab.engine.heat import HeatProfile
from tierlab.engine.sessionlog import read_session_log
from tierlab.widgets.heatmap import ExpertHeatmap, HeatmapData
from tierlab.widgets.knob import Knob
from tierlab.widgets.meters import MeterHistory, MeterPlot, MetersPanel

TINY = dict(vocab=260, hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16, experts=16, top_k=4, inter=32)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(folder: Path, seed: int = 0) -> Path:
    """Write a deterministic tiny Qwen3-MoE (config, safetensors, tokenizer) into `folder`."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    t = TINY
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    H, I, E, hd = t["hidden"], t["inter"], t["experts"], t["head_dim"]
    tensors = {
        "model.embed_tokens.weight": w(t["vocab"], H, scale=0.5),
        "model.norm.weight": np.ones(H, np.float32),
        "lm_head.weight": w(t["vocab"], H, scale=0.3),
    }
    for layer in range(t["layers"]):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = np.ones(H, np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(H, np.float32)
        tensors[p + "self_attn.q_proj.weight"] = w(t["heads"] * hd, H)
        tensors[p + "self_attn.k_proj.weight"] = w(t["kv_heads"] * hd, H)
        tensors[p + "self_attn.v_proj.weight"] = w(t["kv_heads"] * hd, H)
        tensors[p + "self_attn.o_proj.weight"] = w(H, t["heads"] * hd)
        tensors[p + "self_attn.q_norm.weight"] = np.ones(hd, np.float32)
        tensors[p + "self_attn.k_norm.weight"] = np.ones(hd, np.float32)
        tensors[p + "mlp.gate.weight"] = w(E, H, scale=0.6)
        for e in range(E):
            tensors[p + f"mlp.experts.{e}.gate_proj.weight"] = w(I, H)
            tensors[p + f"mlp.experts.{e}.up_proj.weight"] = w(I, H)
            tensors[p + f"mlp.experts.{e}.down_proj.weight"] = w(H, I)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": t["vocab"],
        "hidden_size": H, "intermediate_size": 96, "num_hidden_layers": t["layers"],
        "num_attention_heads": t["heads"], "num_key_value_heads": t["kv_heads"], "head_dim": hd,
        "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": t["top_k"], "norm_topk_prob": True,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 512,
        "bos_token_id": 256, "eos_token_id": 258,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    return folder


# -- the app ---------------------------------------------------------------------


def record_notes(app: TierlabApp) -> TierlabApp:
    """The app, with every notification also kept in `app.notes` as (message, severity)."""
    app.notes = []  # type: ignore[attr-defined]
    original = app.notify

    def notify(message, *args, **kwargs):
        app.notes.append((str(message), kwargs.get("severity", "information")))  # type: ignore[attr-defined]
        return original(message, *args, **kwargs)

    app.notify = notify  # type: ignore[method-assign]
    return app


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-moe")


@pytest.fixture
def make_app(tiny_model, tmp_path):
    def make(model_dir=None, cache_slots=6, tier=None, heat=None, **options) -> TierlabApp:
        options.setdefault("sessions_dir", tmp_path / "sessions")
        engine_options = EngineOptions(model_dir or tiny_model, cache_slots,
                                       TierOptions.from_env(enabled=tier, heat_file=str(heat) if heat else None))
        app = TierlabApp(engine_options, **options)
        return record_notes(app)

    return make


async def wait_for(pilot, condition, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await pilot.pause(0.05)


async def ready(pilot) -> TierlabApp:
    app = pilot.app
    await wait_for(pilot, lambda: app.engine is not None or app.sub_title == "no model")
    assert app.engine is not None, app.notes
    return app


async def ask(pilot, text: str, max_tokens: int = 3) -> ChatMessage:
    """Send a prompt with a small token budget and wait for the whole reply."""
    app = pilot.app
    app.query_one("#max-tokens", Knob).value = max_tokens
    before = app.replies
    prompt = app.query_one("#prompt", Input)
    prompt.focus()
    prompt.value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.replies > before)
    await pilot.pause()
    return list(app.query(ChatMessage))[-1]


async def test_prompt_streams_tokens_into_the_chat(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        partial: list[str] = []
        show = app._show_partial
        app._show_partial = lambda reply, text: (partial.append(text), show(reply, text))  # type: ignore[method-assign]
        real_generate = app.engine.generate

        def paced_generate(*args, **kwargs):  # the real engine, slow enough for the screen to show text midway
            for token in real_generate(*args, **kwargs):
                time.sleep(0.3)
                yield token

        app.engine.generate = paced_generate
        reply = await ask(pilot, "hi", max_tokens=4)
        app.engine.generate = real_generate
        assert reply.role == "assistant"
        chat = app.query_one(ChatPane)
        assert [m["role"] for m in chat.messages] == ["user", "assistant"]
        assert chat.messages[1]["content"] == reply.text
        assert partial, "no text arrived while the reply was being generated"
        prompt_ids = app.engine.tokenizer.encode(app.engine.tokenizer.render_chat([{"role": "user", "content": "hi"}]))
        # the prompt's tokens, then one decode step per new token (the last one's step is optional)
        assert len(prompt_ids) + 3 <= app.watch.tokens_seen <= len(prompt_ids) + 4
        assert app.watch.history.latest["ram_hit"] > 0
        assert app.watch.history.latest["oracle_hit"] == pytest.approx(app.watch.oracle.hit_rate())  # fresh at the end
        # raw mode completes plain text and keeps it out of the chat messages
        await pilot.press("ctrl+t")
        assert chat.raw_mode
        raw = await ask(pilot, "abc", max_tokens=2)
        assert raw.role == "raw"
        assert len(chat.messages) == 2
        # clear conversation
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert not list(app.query(ChatMessage)) and chat.messages == []


async def test_stop_key_ends_a_reply_early(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        real_generate = app.engine.generate

        def slow_generate(*args, **kwargs):  # the real engine, paced so a reply outlasts the key presses
            for token in real_generate(*args, **kwargs):
                time.sleep(0.1)
                yield token

        app.engine.generate = slow_generate
        app.query_one("#max-tokens", Knob).value = 500
        prompt = app.query_one("#prompt", Input)
        prompt.value = "stop me"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.generating and app.watch.tokens_seen > 0)
        # the screen answers keys while the engine works (no time bound: the test machine is shared)
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), timeout=30)
        await pilot.press("escape")  # closes help
        assert app.generating, (app.watch.tokens_seen, app.notes, [m.text for m in app.query(ChatMessage)])
        await pilot.press("escape")  # stops the reply
        await wait_for(pilot, lambda: not app.generating, timeout=30)
        reply = list(app.query(ChatMessage))[-1]
        assert reply.text.endswith("⏹")
        assert app.watch.tokens_seen < 300


async def test_each_knob_reaches_the_engine_and_is_logged(make_app):
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        knobs = app.engine.knobs
        await pilot.press("ctrl+r")
        assert app.recorder is not None
        # switches by mouse
        await pilot.click(f"#{knob_id('CACHE_ROUTE')} Switch")
        await pilot.click(f"#{knob_id('ROUTE_AGREE')} Switch")
        await pilot.pause()
        assert knobs.get("CACHE_ROUTE") is True
        assert knobs.get("ROUTE_AGREE") == "1"
        # the select
        app.query_one(f"#{knob_id('ROUTE_MODE')} Select", Select).value = "prior"
        await pilot.pause()
        assert knobs.get("ROUTE_MODE") == "prior"
        # numeric knobs by keys
        expected = {"ROUTE_J": 1, "ROUTE_M": 13, "ROUTE_P": 0.01, "ROUTE_ALPHA": 0.99, "ROUTE_LAMBDA": 0.21, "PILOT": 1}
        for name, value in expected.items():
            app.query_one(f"#{knob_id(name)}", Knob).focus()
            key = "left" if value < knobs.get(name) else "right"
            await pilot.press(key)
            assert knobs.get(name) == pytest.approx(value), name
        app.query_one(f"#{knob_id(CACHE_SLOTS)}", Knob).focus()
        await pilot.press("left")
        assert app.engine.cache_slots() == 5
        labels = [mark.label for mark in app.watch.history.marks]
        for name in ["CACHE_ROUTE", "ROUTE_AGREE", "ROUTE_MODE", *expected]:
            assert any(label.startswith(name + "=") for label in labels), name
        assert "cache=5" in labels
        await ask(pilot, "go", max_tokens=2)
        path = app.recorder.path
        await pilot.press("ctrl+r")
        assert app.recorder is None
        log = read_session_log(path)
        logged = [c["name"] for c in log.knob_changes]
        for name in ["CACHE_ROUTE", "ROUTE_AGREE", "ROUTE_MODE", *expected, "cache_slots"]:
            assert name in logged, name
        assert all(c["at_token"] == 0 for c in log.knob_changes)  # all made before the first token
        assert log.tokens and log.summary is not None
        # reset to defaults puts every knob back and shows it
        await pilot.click("#reset-knobs")
        await pilot.pause()
        assert knobs.snapshot().changed_from_default() == {}
        assert app.engine.cache_slots() == 6
        assert app.query_one(f"#{knob_id('ROUTE_J')}", Knob).value == 2
        assert app.query_one(f"#{knob_id('CACHE_ROUTE')} Switch", Switch).value is False


async def test_heatmap_cells_follow_the_engine_residency(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await ask(pilot, "x", max_tokens=2)
        app.refresh_views(force=True)
        heatmap = app.query_one(ExpertHeatmap)
        levels = np.stack([app.engine.residency(layer) for layer in range(app.engine.config.n_layers)])
        np.testing.assert_array_equal(heatmap.data.levels, levels)
        assert (levels == 1).sum(axis=1).tolist() == [6] * app.engine.config.n_layers
        assert heatmap.data.chosen.sum(axis=1).tolist() == [4] * app.engine.config.n_layers
        np.testing.assert_array_equal(heatmap.data.heat, app.engine.heat)
        # the per-layer column agrees with the engine's own per-layer counters
        stats = app.engine.store_stats()
        hits, misses = stats.hits, stats.misses
        np.testing.assert_allclose(heatmap.data.layer_hit, 100.0 * hits / (hits + misses))
        assert heatmap.data.last_use.max() == app.watch.tokens_seen - 1
        # the cursor's info line tells the cell's level
        heatmap.focus()
        expert = int(np.flatnonzero(levels[0] == 1)[0])
        heatmap.cursor = (0, expert)
        assert "RAM cache" in heatmap.info_text()


async def test_ab_screen_builds_a_table_from_two_logs(make_app, tmp_path):
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+r")
        await ask(pilot, "a", max_tokens=2)
        await pilot.press("ctrl+r")
        app.engine.knobs.set("CACHE_ROUTE", True)
        app.engine.knobs.set("ROUTE_J", 1)
        time.sleep(1.1)  # log names carry the second
        await pilot.press("ctrl+r")
        await ask(pilot, "a", max_tokens=2)
        await pilot.press("ctrl+r")
        await pilot.press("f3")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, SessionsScreen)
        assert len(screen.logs) == 2
        table = screen.query_one("#sessions-list", DataTable)
        listed = [[str(c) for c in table.get_row_at(i)] for i in range(2)]
        assert "CACHE_ROUTE=1" in listed[0][2] and listed[1][2].startswith("lever off")  # newest first
        assert all(row[2].endswith("cache 6/16") for row in listed)  # the RAM cache is part of the start
        assert all(int(row[3].replace(",", "")) > 0 for row in listed)
        table.move_cursor(row=1)
        await pilot.press("a")
        table.move_cursor(row=0)
        await pilot.press("b")
        await pilot.pause()
        ab = screen.query_one("#ab-table", DataTable)
        assert ab.row_count == 2
        first = [str(c) for c in ab.get_row_at(0)]
        second = [str(c) for c in ab.get_row_at(1)]
        assert first[0].startswith("A: lever off")
        assert "CACHE_ROUTE=1" in second[0] and "ROUTE_J=1" in second[0]
        await pilot.press("e")
        exported = sorted((tmp_path / "sessions").glob("ab-*.md"))
        assert exported and "| row |" in exported[0].read_text()
        await pilot.press("escape")
        assert not isinstance(app.screen, SessionsScreen)


async def test_heat_inspector_loads_compares_and_rejects(make_app, tmp_path):
    good = tmp_path / "a.heat"
    other = tmp_path / "b.heat"
    counts = np.arange(6 * 16, dtype=np.int64).reshape(6, 16)
    HeatProfile(6, 16, counts).write(good)
    HeatProfile(6, 16, counts[:, ::-1].copy()).write(other)
    bad = tmp_path / "bad.heat"
    bad.write_bytes(b"not a heat profile at all")
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await pilot.press("f2")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, HeatInspector)
        screen.query_one("#heat-path-a", Input).value = str(good)
        screen.query_one("#heat-path-a", Input).focus()
        await pilot.press("enter")
        await pilot.pause()
        pane = screen.query_one("#pane-a", ProfilePane)
        assert pane.profile is not None and pane.profile.counts.sum() == counts.sum()
        assert screen.query_one("#stats-a", DataTable).row_count == 6
        np.testing.assert_array_equal(screen.query_one("#heat-map-a", ExpertHeatmap).data.heat, counts)
        # compare with B
        screen.query_one("#heat-path-b", Input).value = str(other)
        await pilot.click("#heat-load")
        await pilot.pause()
        assert screen.has_class("-compare")
        assert screen.query_one("#stats-b", DataTable).row_count == 6
        # profiles of different shapes cannot be compared
        odd = tmp_path / "odd.heat"
        HeatProfile(3, 8).write(odd)
        screen.query_one("#heat-path-b", Input).value = str(odd)
        await pilot.click("#heat-load")
        await pilot.pause()
        assert any("differ in shape" in text and severity == "error" for text, severity in app.notes)
        screen.query_one("#heat-path-b", Input).value = ""
        # a malformed file: a notification, the loaded profile stays
        screen.query_one("#heat-path-a", Input).value = str(bad)
        screen.query_one("#heat-path-a", Input).focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("not a heat profile" in text and severity == "error"
                                          for text, severity in app.notes), timeout=10)
        assert pane.profile.counts.sum() == counts.sum()
        # save this session's heat from the screen
        target = tmp_path / "session.heat"
        screen.query_one("#heat-save-path", Input).value = str(target)
        await pilot.click("#heat-save")
        await pilot.pause()
        assert HeatProfile.read(target).counts.shape == (6, 16)


async def test_help_lists_every_binding(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        rows = app.screen.rows()
        actions = {row[1] for row in rows}
        for binding in app.BINDINGS:
            assert binding.description in actions
        assert {"View mode", "Big step up", "Set A", "Save session heat"} <= actions
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_command_palette_offers_every_action(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        titles = {command.title for command in app.get_system_commands(app.screen)}
        for title in ("Toggle recording", "Heat profile inspector", "Sessions and A/B", "Stop generation",
                      "Clear conversation", "Reset knobs to defaults", "Help: keys and panes", "Theme"):
            assert any(t.startswith(title) for t in titles), title
        await ready(pilot)
        commands = {command.title: command for command in app.get_system_commands(app.screen)}
        commands["ROUTE_MODE = prior"].callback()
        commands["Toggle CACHE_ROUTE"].callback()
        await pilot.pause()
        assert app.engine.knobs.get("ROUTE_MODE") == "prior" and app.engine.knobs.get("CACHE_ROUTE") is True
        assert app.query_one(f"#{knob_id('CACHE_ROUTE')} Switch", Switch).value is True


async def test_bad_model_folder_is_a_notification_not_a_crash(make_app, tmp_path):
    app = make_app(model_dir=tmp_path / "no-such-model")
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.sub_title == "no model")
        assert any(severity == "error" and "not a folder" in text for text, severity in app.notes)
        app.query_one("#prompt", Input).value = "hello"
        await pilot.press("enter")
        await pilot.pause()
        assert any(text == "no model loaded" for text, _ in app.notes)
        await pilot.press("ctrl+r", "f2")
        await pilot.pause()
        assert isinstance(app.screen, HeatInspector)


async def test_engine_error_during_generation_is_a_notification(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)

        def broken(*args, **kwargs):
            raise RuntimeError("tier failed: device lost")
            yield  # pragma: no cover

        app.engine.generate = broken
        reply = await ask(pilot, "hi")
        assert reply.text == ""
        assert any("device lost" in text and severity == "error" for text, severity in app.notes)
        assert not app.generating


# -- snapshots -------------------------------------------------------------------

def snapshot_heatmap(n_layers: int, n_experts: int) -> HeatmapData:
    """A fixed picture for the heatmap: residency, heat, one token's choice, swaps and per-layer hits."""
    layers, experts = np.meshgrid(np.arange(n_layers), np.arange(n_experts), indexing="ij")
    data = HeatmapData.empty(n_layers, n_experts)
    data.levels[:] = np.where((layers + experts) % 5 == 0, 2, np.where((layers * 3 + experts) % 4 == 0, 1, 0))
    data.heat[:] = (layers * 7 + experts * 13) % 23
    data.chosen[:] = (experts - layers) % 4 == 0
    data.swapped[:] = data.chosen & (experts % 8 == 4)
    data.last_use[:] = np.where(data.heat > 5, 40 - layers, -1)
    data.swap_counts[:] = (experts % 8 == 4) * (layers + 1)
    data.layer_hit = np.linspace(45.0, 90.0, n_layers)
    data.token = 41
    return data


def snapshot_meters() -> MeterHistory:
    """Forty tokens of fixed meter values with one knob change at token 20."""
    history = MeterHistory()
    for t in range(40):
        lever = t >= 20
        history.add(t, {"ram_hit": (45.0 + t * (1.0 if lever else 0.2)) / 100, "vram_hit": 0.0, "oracle_hit": 0.8,
                        "swap": 0.106 if lever else 0.0, "swaps_to_vram": 0, "route_agree": 0.894 if lever else 1.0,
                        "route_kl": 1.85 if lever else 0.0, "tok_s": 12.0 + (t % 5), "fetch_ms": 2.5, "compute_ms": 40.0})
    history.mark(20, "CACHE_ROUTE=1")
    return history


async def settle_for_snapshot(pilot) -> None:
    """The real app and engine, showing a fixed conversation, heatmap and meters: only the UI is pictured.

    Replies, residency and timings come from the engine and the machine, and change whenever either
    does; the UI is what these snapshots are about.
    """
    app = await ready(pilot)
    chat = app.query_one(ChatPane)
    chat.add("user", "Why do experts move between tiers?")
    chat.add("assistant", "The router picks a few experts per token; the cache keeps the recent ones close.")
    config = app.engine.config
    app.query_one(ExpertHeatmap).update_data(snapshot_heatmap(config.n_layers, config.n_experts), now=True)
    history = snapshot_meters()
    app.query_one(MetersPanel).show(history)
    app.query_one(MeterPlot).show(history)
    app.query_one(ExpertHeatmap).focus()
    await pilot.pause(0.3)


@pytest.mark.parametrize("size", [(100, 30), (160, 48)], ids=["100x30", "160x48"])
def test_main_screen_snapshot(snap_compare, make_app, size):
    assert snap_compare(make_app(), terminal_size=size, run_before=settle_for_snapshot)


# -- a real terminal ---------------------------------------------------------------


def test_tmux_smoke(tiny_model, tmp_path):
    """tmux is a test prerequisite (`make test` checks for it); the script fails without it."""
    import os
    import subprocess
    import sys

    script = Path(__file__).with_name("tmux_smoke.sh")
    env = dict(os.environ, PYTHON=sys.executable)
    result = subprocess.run(["bash", str(script), str(tiny_model), str(tmp_path / "work")], env=env,
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tmux smoke: ok" in result.stdout


async def test_tier_puts_experts_at_the_gpu_level(make_app, tmp_path):
    heat = tmp_path / "plan.heat"
    HeatProfile(6, 16, np.tile(np.arange(16, dtype=np.int64), (6, 1))).write(heat)
    app = make_app(tier=True, heat=heat)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.pause(0.2)
        levels = app.query_one(ExpertHeatmap).data.levels
        assert app.engine.tier_description() is not None, f"no OpenCL tier (pyopencl[pocl] should provide a device): {app.notes}"
        assert any("GPU tier on" in text for text, _ in app.notes)
        assert (levels == 2).any()
        np.testing.assert_array_equal(levels[0], app.engine.residency(0))


async def test_tier_without_a_matching_device_says_why(make_app, monkeypatch):
    monkeypatch.setenv("TIER_DEVICE", "no-such-device")
    app = make_app(tier=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.pause(0.2)
        assert app.engine.tier_description() is None
        assert any("no GPU tier" in text for text, _ in app.notes)
        assert not (app.query_one(ExpertHeatmap).data.levels == 2).any()


def test_tierlab_alone_opens_the_app_on_the_shipped_model(monkeypatch, tiny_model):
    import tierlab
    from tierlab.app.cli import main as cli

    opened = []
    monkeypatch.setattr(TierlabApp, "run", lambda self, *a, **k: opened.append(self))
    assert cli.main([]) == 0
    assert opened and opened[0].model_dir == tierlab.ASSETS_DIR / "tiny-moe"
    somewhere = str(tierlab.ASSETS_DIR / "tiny-moe-8x2")
    assert cli.main(["app", "--model", somewhere, "--cache", "3", "--tier", "--heat", "h.heat", "--max-tokens", "9",
                     "--theme", "nord"]) == 0
    app = opened[-1]
    assert (str(app.model_dir), app.options.cache, app.tier, str(app.heat_path), app.max_tokens, app.start_theme) == (
        somewhere, 3, True, "h.heat", 9, "nord")
    # options alone open the app, and the app takes every command's knob flags
    assert cli.main(["--model", str(tiny_model), "--route-j", "1", "--cache-route", "1"]) == 0
    app = opened[-1]
    assert str(app.model_dir) == str(tiny_model)
    assert (app.options.knobs["ROUTE_J"], app.options.knobs["CACHE_ROUTE"]) == ("1", "1")
    assert cli.main(["--meter-window", "8"]) == 0 and opened[-1].meter_window == 8
    assert cli.main(["--meter-window", "0"]) == 2  # one line, no app


async def test_theme_option(make_app):
    app = make_app(theme="nord")
    async with app.run_test(size=(100, 30)) as pilot:
        assert app.theme == "nord"
    app = make_app(theme="no-such-theme")
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        assert any("no theme" in text for text, _ in app.notes)


async def test_a_model_without_chat_template_starts_in_raw_mode(make_app, tiny_model, tmp_path):
    import shutil

    plain = tmp_path / "plain-moe"
    shutil.copytree(tiny_model, plain)
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    app = make_app(model_dir=plain)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.pause()
        assert app.query_one(ChatPane).raw_mode
        assert any("no chat template" in text for text, _ in app.notes)
        reply = await ask(pilot, "abc", max_tokens=2)
        assert reply.role == "raw"


async def test_clearing_during_a_reply_stops_it_and_leaves_an_empty_chat(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        real_generate = app.engine.generate

        def slow_generate(*args, **kwargs):
            for token in real_generate(*args, **kwargs):
                time.sleep(0.1)
                yield token

        app.engine.generate = slow_generate
        app.query_one("#max-tokens", Knob).value = 500
        app.query_one("#prompt", Input).value = "go on"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.generating and app.watch.tokens_seen > 0)
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: not app.generating, timeout=30)
        await pilot.pause()
        chat = app.query_one(ChatPane)
        assert chat.messages == [] and not list(app.query(ChatMessage))
        reply = await ask(pilot, "again", max_tokens=2)
        assert [m["role"] for m in chat.messages] == ["user", "assistant"] and reply.role == "assistant"


async def test_the_lever_shows_swaps_in_the_heatmap_and_meters(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        app.engine.knobs.set("CACHE_ROUTE", True)
        app.engine.knobs.set("ROUTE_J", 1)
        await ask(pilot, "hello", max_tokens=4)
        app.refresh_views(force=True)
        heatmap = app.query_one(ExpertHeatmap)
        assert heatmap.data.swap_counts.sum() > 0
        assert app.watch.history.latest["swap"] > 0 and app.watch.history.latest["route_agree"] < 1
        heatmap.mode = "swaps"
        assert "swaps" in heatmap.render().plain.split("\n")[-2]


ASSETS = __import__("tierlab").ASSETS_DIR


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-moe-8x2"])
async def test_the_shipped_models_answer_in_the_app(name, tmp_path):
    app = TierlabApp(EngineOptions(ASSETS / name), sessions_dir=tmp_path)
    app.notes = []  # type: ignore[attr-defined]
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        reply = await ask(pilot, "Once upon a time", max_tokens=6)
        assert reply.text.strip()
        assert app.query_one(ExpertHeatmap).data.heat.sum() > 0


async def test_engine_notices_such_as_a_failed_tier_become_notifications(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        real_generate = app.engine.generate

        def failing_tier_generate(*args, **kwargs):  # the real engine; its tier "fails" after the first token
            for n, token in enumerate(real_generate(*args, **kwargs)):
                if n == 0:
                    app.engine.notice("GPU tier disabled (device lost): computing on the CPU")
                yield token

        app.engine.generate = failing_tier_generate
        await ask(pilot, "hi", max_tokens=3)
        assert any("GPU tier disabled" in text for text, _ in app.notes)
        assert not app.engine.notices


async def test_an_engine_factory_replaces_the_model_folder(tiny_model, tmp_path):
    from tierlab.engine.model import load_engine

    app = TierlabApp(engine_factory=lambda: load_engine(tiny_model, cache_slots=3), sessions_dir=tmp_path)
    app.notes = []  # type: ignore[attr-defined]
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        assert app.query_one(f"#{knob_id(CACHE_SLOTS)}", Knob).value == 3
        assert "cache 3" in app.sub_title


# -- meters over windows, knob changes mid-reply ---------------------------------------


async def test_a_knob_moved_during_a_reply_starts_a_segment_and_the_old_one_stops_growing(make_app):
    def open_engine():
        engine = EngineOptions(ASSETS / "tiny-moe", 8).open()
        engine.eos_ids = lambda: []  # the reply runs to its token budget, long enough to move a knob in it
        step = engine.step

        def paced_step(token_id):  # at least 2 ms a token: on a quiet machine 512 tokens of tiny-moe end too soon
            time.sleep(0.002)
            return step(token_id)

        engine.step = paced_step
        return engine

    app = make_app(engine_factory=open_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        app.query_one("#max-tokens", Knob).value = 512
        prompt = app.query_one("#prompt", Input)
        prompt.focus()
        prompt.value = "Once upon a time"
        await pilot.press("enter")
        watch = app.watch
        await wait_for(pilot, lambda: watch.last_event is not None and watch.last_event.phase == "decode")
        first_decode = watch.tokens_seen
        await wait_for(pilot, lambda: watch.tokens_seen > first_decode + 5)
        old_seq = app.engine.knobs.seq
        app.set_engine_knob("CACHE_ROUTE", True)  # what the switch does, while tokens stream
        new_seq = app.engine.knobs.seq
        assert new_seq == old_seq + 1 and app.generating

        def segment(seq):
            found = [(s, k) for s, k in watch.segments() if s.knob_seq == seq]
            return found[-1] if found else (None, None)

        await wait_for(pilot, lambda: segment(new_seq)[0] is not None and segment(new_seq)[0].meters["tokens"] >= 2)
        new, new_knobs = segment(new_seq)
        old, old_knobs = segment(old_seq)
        assert old_knobs.CACHE_ROUTE is False and new_knobs.CACHE_ROUTE is True
        assert old.end == new.first  # the next token after the change is the new setting's first
        old_tokens = old.meters["tokens"]
        await wait_for(pilot, lambda: watch.tokens_seen > new.end + 10)
        assert app.generating  # still the same reply
        later_old, _ = segment(old_seq)
        later_new, _ = segment(new_seq)
        assert (later_old.first, later_old.end, later_old.meters["tokens"]) == (old.first, old.end, old_tokens)
        assert later_new.meters["tokens"] > new.meters["tokens"]
        assert later_new.meters["decisions"] > 0 and later_old.meters["decisions"] == 0  # the lever ran in the new one only
        assert watch.last_event.knob_seq == new_seq
        app.action_stop()
        await wait_for(pilot, lambda: not app.generating)


async def test_meters_window_key_names_the_window_and_reset_blanks_the_lever_meters(make_app):
    app = make_app(model_dir=ASSETS / "tiny-moe", cache_slots=8)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        box = app.query_one("#meters-box")
        assert box.border_title == "Meters · last 32 tok"
        app.engine.knobs.set("CACHE_ROUTE", True)
        await ask(pilot, "hello", max_tokens=6)
        app.refresh_views(force=True)
        latest = app.watch.history.latest
        assert latest["swap"] is not None and latest["route_agree"] is not None
        assert latest["shadow_hit"] is not None and latest["ram_hit"] is not None
        await pilot.press("f5")
        assert box.border_title == "Meters · since knob change"
        await pilot.press("f5")
        assert box.border_title == "Meters · since start"
        await pilot.press("f5")
        assert box.border_title == "Meters · last 32 tok"
        assert any(b.key == "f5" and b.show for b in app.BINDINGS)  # listed in the footer and the help
        app.action_reset_knobs()  # F6: the lever goes off
        app.refresh_views(force=True)
        await pilot.pause()
        for window in range(3):
            latest = app.watch.meter_history().latest
            assert latest["swap"] is None and latest["route_agree"] is None and latest["route_kl"] is None, window
            await pilot.press("f5")
        from tierlab.widgets.meters import MeterRow

        shown = str(app.query_one("#meter-swap", MeterRow).query_one(".meter--value").render())
        assert shown.strip() == "–"


async def test_the_meters_box_names_the_lru_hit_rates_of_other_cache_sizes(make_app):
    """The oracle band on screen: LRU at half, twice and four times the cache beside the realised hit."""
    app = make_app()  # 6 of 16 slots: half and twice replay, four times (24) exceeds the experts
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        assert app.query_one("#meters-box").border_subtitle == ""  # no replay before the first token
        await ask(pilot, "Once upon a time", max_tokens=6)
        reading = app.watch.oracle_reading()
        assert reading is not None and reading.sizes["lru_half"] == 3 and reading.sizes["lru_2x"] == 12
        band = reading.meters()
        subtitle = str(app.query_one("#meters-box").border_subtitle)
        assert subtitle == (f"LRU ½× {100 * band['lru_half']:.1f}% · 2× {100 * band['lru_2x']:.1f}% · 4× –")
        assert band["lru_half"] <= band["lru_2x"]


async def test_the_recent_window_takes_its_length_from_the_app(make_app):
    app = make_app(meter_window=8)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        assert app.query_one("#meters-box").border_title == "Meters · last 8 tok"
        assert app.watch.windows.recent == 8
