"""Qwen3.x's `enable_thinking`: into the template's context, `--thinking on|off`, the app's switch."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from conftest import PYTHON, run_cli
from qwen_template import THINKING_OFF_BY_DEFAULT, THINKING_TEMPLATE, with_template
from tierlab.app.tui.app import TierlabApp
from tierlab.app.tui.chat import ChatPane
from tierlab.engine.options import EngineOptions, default_model
from tierlab.engine.tiering import TierOptions
from tierlab.engine.tokenizer import Tokenizer
from tierlab.widgets.knob import KnobSwitch

TURN = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    return with_template(default_model(), tmp_path_factory.mktemp("thinking") / "tiny-moe", THINKING_TEMPLATE)


def test_the_rendered_ids_follow_enable_thinking(thinking_model):
    tok = Tokenizer.from_folder(thinking_model)
    unset, on, off = (tok.encode(tok.render_chat(TURN, enable_thinking=v)) for v in (None, True, False))
    assert unset == on != off
    assert off[:len(on)] == on and tok.decode(off[len(on):]) == "<think>\n\n</think>\n\n"
    assert tok.thinking_default() is True
    assert [tok.decode(tail) for tail in tok.dropped_tails()] == ["<think>\n\n</think>\n\n"]
    assert Tokenizer.from_folder(default_model()).dropped_tails() == []


def test_the_default_is_the_templates_own(tmp_path):
    tok = Tokenizer.from_folder(with_template(default_model(), tmp_path / "m", THINKING_OFF_BY_DEFAULT))
    unset, off = (tok.render_chat(TURN, enable_thinking=v) for v in (None, False))
    assert unset == off and tok.thinking_default() is False
    shipped = Tokenizer.from_folder(default_model())
    assert shipped.thinking_default() is None
    assert shipped.render_chat(TURN, enable_thinking=False) == shipped.render_chat(TURN)


def test_generate_takes_thinking_on_and_off(thinking_model):
    ids = {}
    for value in ("on", "off"):
        r = run_cli("generate", "--model", str(thinking_model), "--prompt", "hi", "--chat", "--thinking", value,
                    "-n", "2", "--json")
        assert r.returncode == 0, r.stderr
        ids[value] = json.loads(r.stdout.strip().splitlines()[-1])["prompt_ids"]
    tok = Tokenizer.from_folder(thinking_model)
    assert tok.decode(ids["off"][len(ids["on"]):]) == "<think>\n\n</think>\n\n"


def test_thinking_outside_a_chat_is_one_line_exit_2():
    r = run_cli("generate", "--prompt", "hi", "--thinking", "off")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "tierlab: error: --thinking needs --chat (it is a setting of the chat template)"]
    r = run_cli("generate", "--prompt", "hi", "--chat", "--thinking", "maybe")
    assert r.returncode == 2 and "--thinking" in r.stderr and "Traceback" not in r.stderr


def test_chat_command_says_when_the_switch_does_nothing():
    r = subprocess.run([PYTHON, "-m", "tierlab", "chat", "--thinking", "off", "-n", "2"], input="hi\n",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "has no thinking switch" in r.stderr and r.stdout.strip()


async def _wait(pilot, condition, timeout=90.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await pilot.pause(0.05)


async def test_the_app_shows_and_switches_thinking(thinking_model, tmp_path):
    app = TierlabApp(EngineOptions(thinking_model, 6, TierOptions.from_env(enabled=False)),
                     sessions_dir=tmp_path / "sessions")
    async with app.run_test(size=(100, 30)) as pilot:
        await _wait(pilot, lambda: app.engine is not None)
        await pilot.pause()
        chat = app.query_one(ChatPane)
        switch = app.query_one("#thinking", KnobSwitch)
        assert switch.display and chat.thinking is True  # the template's default
        commands = {command.title: command for command in app.get_system_commands(app.screen)}
        commands["Toggle thinking"].callback()
        await pilot.pause()
        assert chat.thinking is False and switch.value is False
        app.query_one("#max-tokens").value = 2
        app.query_one("#prompt").value = "Why is the sky blue?"
        await pilot.press("enter")
        await _wait(pilot, lambda: app.replies == 1)
        tok = app.engine.tokenizer
        want = tok.encode(tok.render_chat([{"role": "user", "content": "Why is the sky blue?"}], enable_thinking=False))
        assert app.engine.sequence_ids()[:len(want)] == want


async def test_the_switch_is_hidden_without_a_thinking_template(tmp_path):
    app = TierlabApp(EngineOptions(default_model(), 6, TierOptions.from_env(enabled=False)),
                     sessions_dir=tmp_path / "sessions")
    async with app.run_test(size=(100, 30)) as pilot:
        await _wait(pilot, lambda: app.engine is not None)
        await pilot.pause()
        assert not app.query_one("#thinking", KnobSwitch).display and app.query_one(ChatPane).thinking is None
