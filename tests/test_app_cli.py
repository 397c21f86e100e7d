"""How the app is opened from the command line: the flags people try first, and bad input before the screen."""

from __future__ import annotations

import subprocess
from pathlib import Path

import tierlab
from tierlab.app.cli import main as cli
from tierlab.app.tui.app import TierlabApp

REPO = Path(__file__).resolve().parent.parent


def opened_apps(monkeypatch) -> list[TierlabApp]:
    opened: list[TierlabApp] = []
    monkeypatch.setattr(TierlabApp, "run", lambda self, *a, **k: opened.append(self))
    return opened


def test_model_and_knob_flags_without_a_command_open_the_app(monkeypatch):
    opened = opened_apps(monkeypatch)
    model = str(tierlab.ASSETS_DIR / "tiny-moe")
    assert cli.main(["--model", model]) == 0
    assert str(opened[-1].model_dir) == model
    assert cli.main(["app", "--route-j", "1", "--route-m", "8", "--cache-route", "on", "--route-agree", "1"]) == 0
    knobs = opened[-1].options.knobs
    assert (knobs["ROUTE_J"], knobs["ROUTE_M"], knobs["CACHE_ROUTE"], knobs["ROUTE_AGREE"]) == ("1", "8", "on", "1")


def test_make_run_hands_its_args_to_tierlab():
    dry = subprocess.run(["make", "-n", "run", "ARGS=--model assets/tiny-moe"], cwd=REPO, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert ".venv/bin/tierlab --model assets/tiny-moe" in dry.stdout


def test_a_bad_model_or_knob_is_one_line_before_the_screen_opens(monkeypatch, tmp_path, capsys):
    opened = opened_apps(monkeypatch)
    assert cli.main(["--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nowhere" in err[0] and "config.json" in err[0]
    assert cli.main(["app", "--route-j", "many"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ROUTE_J" in err[0]
    assert opened == []


def test_heat_show_help_names_the_format_the_app_writes(capsys):
    import pytest

    with pytest.raises(SystemExit):
        cli.main(["heat", "show", "--help"])
    out = capsys.readouterr().out
    assert ".heat" in out and ".bin" not in out


def test_eval_says_why_it_exits_1_with_the_lever_on(monkeypatch, capsys):
    monkeypatch.setenv("CACHE_ROUTE", "1")
    monkeypatch.setenv("ROUTE_J", "1")
    ref = str(tierlab.ASSETS_DIR / "tiny-moe" / "ref.json")
    assert cli.main(["eval", "--ref", ref, "--cache", "8"]) == 1
    err = capsys.readouterr().err
    assert "exit 1:" in err and "greedy ids match the reference" in err


def test_sessions_folder_is_ignored_by_git():
    assert "tierlab-sessions/" in (REPO / ".gitignore").read_text().split()
