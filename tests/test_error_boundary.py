"""The one error boundary and the template budget: bad flags, settings, configs and chat
templates end in one line and exit 2; a bug shows its traceback with TIERLAB_DEBUG=1; the app
shows such failures as notifications and keeps running."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from conftest import PYTHON, REPO, run_cli
from tierlab.app.cli.errors import classify
from tierlab.engine.errors import TemplateError
from tierlab.engine.tokenizer import ChatTemplate, Tokenizer

SHIPPED = REPO / "assets" / "tiny-moe"


def assert_one_line_error(proc, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    # A cold numba cache reports the kernels' compilation first: progress, not part of the error.
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("tierlab: compiling kernels")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tierlab: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture()
def model_copy(tmp_path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(SHIPPED, dst)
    return dst


# -- flags and settings -------------------------------------------------------------


@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--temperature", "nan"), ("--top-p", "0"),
                                         ("--top-p", "1.5"), ("--seed", "-1")])
def test_bad_sampling_flag_is_one_line_naming_the_flag(flag, value):
    proc = run_cli("generate", "--model", str(SHIPPED), "--prompt", "hi", "-n", "2", flag, value)
    assert_one_line_error(proc, flag)


@pytest.mark.parametrize("budget", ["inf", "-inf", "nan", "0"])
def test_tier_budget_must_be_finite_and_positive(budget):
    proc = run_cli("generate", "--model", str(SHIPPED), "--prompt", "hi", "-n", "2", "--tier",
                   env={"TIER_GB": budget})
    assert_one_line_error(proc, "TIER_GB", budget)


@pytest.mark.parametrize("row, needle", [("CACHE=abc", "CACHE=abc"), ("CACHE=0", "CACHE=0"),
                                         ("TIER_GB=inf", "TIER_GB")])
def test_ab_row_with_unreadable_engine_setting(row, needle):
    proc = run_cli("ab", "--model", str(SHIPPED), "--ref", str(SHIPPED / "ref.json"), "--row", "off", "--row", row,
                   "--repeat", "1", "--no-tf")
    line = assert_one_line_error(proc, needle)
    assert f"row {row!r}" in line


@pytest.mark.parametrize("field, value", [("eos_token_id", "two"), ("eos_token_id", [2, "x"]),
                                          ("rms_norm_eps", "tiny"), ("rope_theta", -1),
                                          ("tie_word_embeddings", "no"), ("bos_token_id", 1.5),
                                          ("partial_rotary_factor", 4)])
def test_config_field_of_the_wrong_type_names_the_field(model_copy, field, value):
    config = json.loads((model_copy / "config.json").read_text())
    config[field] = value
    (model_copy / "config.json").write_text(json.dumps(config))
    proc = run_cli("generate", "--model", str(model_copy), "--prompt", "hi", "-n", "2")
    assert_one_line_error(proc, "config.json", field)


def test_a_missing_file_names_the_file(tmp_path):
    proc = run_cli("ab", "--model", str(SHIPPED), "--ref", str(tmp_path / "nowhere.json"), "--row", "off")
    assert_one_line_error(proc, "nowhere.json")


# -- the boundary itself -------------------------------------------------------------

INJECTED_BUG = """
import sys
from tierlab.app.cli import cmd_inspect, main

def broken(args):
    raise TypeError("injected bug")

cmd_inspect.run = broken
sys.exit(main.main(["inspect", sys.argv[1]]))
"""


def run_with_injected_bug(debug: bool):
    env = {"TIERLAB_DEBUG": "1"} if debug else {"TIERLAB_DEBUG": ""}
    import os

    return subprocess.run([PYTHON, "-c", INJECTED_BUG, str(SHIPPED)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_a_bug_is_one_line_and_exit_1_without_debug():
    proc = run_with_injected_bug(debug=False)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "tierlab: error: internal error: TypeError: injected bug (set TIERLAB_DEBUG=1 for the traceback)"]


def test_tierlab_debug_shows_the_traceback_of_a_bug():
    proc = run_with_injected_bug(debug=True)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr
    assert "TypeError: injected bug" in proc.stderr


def test_a_kernel_failure_on_bad_data_is_input_and_names_the_cause():
    try:
        try:
            raise ZeroDivisionError("division by zero")
        except ZeroDivisionError:
            raise SystemError("CPUDispatcher(<function moe>) returned a result with an exception set")
    except SystemError as exc:
        code, line = classify(exc)
    assert code == 2
    assert "ZeroDivisionError: division by zero" in line


@pytest.mark.parametrize("exc, code, needle", [
    (FileNotFoundError(2, "No such file or directory", "/x/heat.json"), 2, "/x/heat.json: No such file"),
    (RecursionError("maximum recursion depth exceeded"), 2, "nested too deeply"),
    (MemoryError(), 2, "out of memory"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), 2, "invalid start byte"),
    (OverflowError("cannot convert float infinity to integer"), 2, "infinity"),
    (KeyError("layer"), 1, "internal error: KeyError"),
])
def test_classification(exc, code, needle):
    got_code, line = classify(exc)
    assert got_code == code
    assert needle in line
    assert "\n" not in line


# -- chat templates with a budget -------------------------------------------------------

BAD_TEMPLATES = {
    "huge range": "{% for i in range(10**30) %}x{% endfor %}",
    "huge string": "{{ 'x'*10**12 }}",
    "recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "nested large loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over a string": "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}y{% endfor %}{% endfor %}",
    "doubling": "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "branching macro": "{% macro f(n) %}{% for i in range(10) %}{{ f(n + 1) }}{% endfor %}{% endmacro %}{{ f(0) }}",
    "division by zero": "{{ 1/0 }}",
    "wide centre": "{{ 'x'|center(10**12) }}",
    "wide format": "{{ '{:>1000000000}'.format(1) }}",
    "wide percent": "{{ '%*d' % (10**9, 1) }}",
    "huge power": "{{ 10 ** 100000 }}",
    "huge join": "{{ (['x'] * 1000000)|join('y' * 1000) }}",
    "huge output": "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
    "endless lipsum": "{{ lipsum(10 ** 6) }}",
}


def _set_template(folder: Path, template: str) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name", sorted(BAD_TEMPLATES))
def test_bad_template_is_refused_in_process(name):
    template = ChatTemplate(BAD_TEMPLATES[name], Path("chat_template.jinja"), {})
    with pytest.raises(TemplateError) as info:
        template.render([{"role": "user", "content": "hi"}])
    assert str(info.value).startswith("chat_template.jinja: chat template ")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["huge range", "huge string", "recursive macro", "nested large loops",
                                  "division by zero", "huge output"])
def test_bad_template_is_one_line_from_generate(model_copy, name):
    _set_template(model_copy, BAD_TEMPLATES[name])
    proc = run_cli("generate", "--model", str(model_copy), "--prompt", "hi", "--chat", "-n", "2", timeout=120)
    assert_one_line_error(proc, "tokenizer_config.json", "chat template")


GOOD_TEMPLATES = [
    # The chat form the shipped model carries.
    json.loads((SHIPPED / "tokenizer_config.json").read_text())["chat_template"],
    # The features real templates use: namespaces, macros, filters, loop variables, str methods.
    "{%- set ns = namespace(system='') -%}"
    "{%- macro line(role, text) -%}<|im_start|>{{ role }}\n{{ text | trim }}<|im_end|>\n{%- endmacro -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' %}{% set ns.system = m.content %}{% else -%}"
    "{{ line(m.role, m['content']) }}{{ loop.index ~ '/' ~ loop.length }}{{ '%03d' % loop.index }}"
    "{{ '{}:{:>4}'.format(m.role|upper, m.content|length) }}{{ m.content.split(' ')|join('_') }}"
    "{{ m.content|replace('a', 'A')|center(20) }}{{ [1, 2, 3]|map('string')|join(',') }}{{ 2 ** 10 }}"
    "{%- endif -%}{%- endfor -%}{{ ns.system * 2 }}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    # Blocks with their own filters, recursive loops, macro defaults, dict items, tojson.
    "{% set head | upper %}{{ messages[0].role }}{% endset %}{% filter trim %}  {{ head }}  {% endfilter %}"
    "{% for m in messages recursive %}{{ loop.depth }}{{ m.content|title }}{% endfor %}"
    "{% macro tag(name='x'|upper) %}<{{ name }}>{% endmacro %}{{ tag() }}{{ tag('y') }}"
    "{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% else %}none{% endfor %}"
    "{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|list|tojson }}",
]
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a cat sat"},
                {"role": "assistant", "content": "on a mat"}, {"role": "user", "content": "and then?"}]


@pytest.mark.parametrize("index", range(len(GOOD_TEMPLATES)))
def test_good_template_renders_as_the_plain_sandbox_does(index):
    source = GOOD_TEMPLATES[index]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    for gen in (True, False):
        expected = plain.render(messages=CONVERSATION, add_generation_prompt=gen, bos_token="", eos_token="x",
                                pad_token="")
        got = ChatTemplate(source, Path("t.jinja"), {"bos_token": "", "eos_token": "x", "pad_token": ""}).render(
            CONVERSATION, add_generation_prompt=gen)
        assert got == expected


def test_shipped_template_renders_a_long_chat_within_the_budget():
    tok = Tokenizer.from_folder(SHIPPED)
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20} for i in range(2000)]
    text = tok.render_chat(chat)
    assert text.count("<|im_start|>") == 2001


# -- the app -------------------------------------------------------------------------

from test_app import ask, make_app, ready, tiny_model, wait_for  # noqa: E402,F401 (the app fixtures)


async def test_app_keeps_running_when_the_template_fails(make_app, tiny_model, tmp_path):
    from textual.widgets import Input

    from tierlab.app.tui.chat import ChatMessage

    folder = tmp_path / "bad-template"
    shutil.copytree(tiny_model, folder)
    _set_template(folder, BAD_TEMPLATES["nested large loops"])
    app = make_app(model_dir=folder)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        prompt = app.query_one("#prompt", Input)
        for attempt in (1, 2):
            prompt.focus()
            prompt.value = f"hello {attempt}"
            await pilot.press("enter")
            await wait_for(pilot, lambda: sum("loop steps" in text for text, _ in app.notes) == attempt)
        assert app.is_running
        assert not app.generating
        assert not list(app.query(ChatMessage))  # a refused turn adds nothing to the chat
        errors = [text for text, severity in app.notes if "loop steps" in text]
        assert all(text.startswith(str(folder / "tokenizer_config.json")) for text in errors), errors


async def test_app_shows_a_bad_config_as_a_notification(make_app, tiny_model, tmp_path):
    folder = tmp_path / "bad-config"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = "two"
    (folder / "config.json").write_text(json.dumps(config))
    app = make_app(model_dir=folder)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.sub_title == "no model")
        assert app.is_running
        assert any("eos_token_id" in text and severity == "error" for text, severity in app.notes), app.notes
