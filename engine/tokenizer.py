"""Text in and out: tokenizer.json through `tokenizers`, chat templates in a sandbox.

A chat template is code shipped with an untrusted checkpoint, so it is
rendered by jinja2's immutable sandbox with a budget (`template_budget`); a
template that reaches for Python internals, raises, or runs past its budget
raises TemplateError (one line naming the template's file) instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError as JinjaTemplateError
from jinja2.exceptions import SecurityError

from tierlab.engine.bounded_read import read_text
from tierlab.engine.errors import ModelError, TemplateError
from tierlab.engine.template_budget import BudgetedSandbox, TemplateBudgetError


def _raise_exception(message: str):
    raise TemplateError(f"chat template raised: {message}")


class ChatTemplate:
    def __init__(self, source: str, origin: Path, special: dict[str, str]) -> None:
        self.origin = origin
        self.special = special
        self.env = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True)
        self.env.globals["raise_exception"] = _raise_exception
        try:
            self.template = self.env.from_string(self.env.budget_source(source))
        except JinjaTemplateError as exc:
            raise TemplateError(f"chat template does not parse: {exc}", origin) from None
        except (RecursionError, MemoryError, ValueError, OverflowError) as exc:
            raise TemplateError(f"chat template does not parse: {type(exc).__name__}", origin) from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        try:
            return self.env.render_budgeted(self.template, messages=messages,
                                            add_generation_prompt=add_generation_prompt, **self.special, **extra)
        except TemplateBudgetError as exc:
            raise TemplateError(f"chat template refused: it went past its budget ({exc})", self.origin) from None
        except RecursionError:
            raise TemplateError("chat template refused: it recurses too deeply", self.origin) from None
        except MemoryError:
            raise TemplateError("chat template refused: it ran out of memory", self.origin) from None
        except SecurityError as exc:
            raise TemplateError(f"chat template tried to leave the sandbox ({exc})", self.origin) from None
        except TemplateError as exc:
            raise TemplateError(str(exc), self.origin) from None
        except (JinjaTemplateError, TypeError, ValueError, ArithmeticError, AttributeError, KeyError,
                IndexError) as exc:
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {_first_line(exc)}", self.origin) from None


THINKING_PROBE = [{"role": "user", "content": "?"}]
"""The conversation rendered to find out what a template does with `enable_thinking`."""


MAX_TAIL = 16
"""A generation prompt's tail longer than this is not a thinking marker: no snapshot for it."""


def thinking_context(enable_thinking: bool | None) -> dict:
    """The template variables for a thinking setting: None leaves `enable_thinking` undefined,
    so the template's own default holds."""
    return {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def _token_text(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    def __init__(self, path: Path, config: dict, template: ChatTemplate | None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        text = read_text(path, "tokenizer.json", ModelError)
        try:
            self._tok = HFTokenizer.from_str(text)
        except Exception as exc:  # the tokenizers library raises plain Exception subclasses
            raise ModelError(f"cannot load tokenizer: {str(exc).splitlines()[0]}", path) from None
        self.path = path
        self.chat_template = template
        eos = _token_text(config.get("eos_token"))
        self.eos_ids = []
        for text in filter(None, [eos, "<|im_end|>", "<|endoftext|>"]):
            tid = self._tok.token_to_id(text)
            if tid is not None and tid not in self.eos_ids:
                self.eos_ids.append(tid)

    @classmethod
    def from_folder(cls, folder: Path) -> "Tokenizer":
        folder = Path(folder)
        cfg_path = folder / "tokenizer_config.json"
        config: dict = {}
        if cfg_path.exists():
            text = read_text(cfg_path, "tokenizer_config.json", ModelError)
            try:
                config = json.loads(text)
            except RecursionError:
                raise ModelError("nested too deeply", cfg_path) from None
            except json.JSONDecodeError as exc:
                raise ModelError(f"cannot read: {exc}", cfg_path) from None
            if not isinstance(config, dict):
                raise ModelError("not a JSON object", cfg_path)
        source, origin = None, cfg_path
        raw = config.get("chat_template")
        if isinstance(raw, str):
            source = raw
        elif isinstance(raw, list):  # named templates: take "default"
            for entry in raw:
                if isinstance(entry, dict) and entry.get("name") == "default":
                    source = entry.get("template")
        jinja_path = folder / "chat_template.jinja"
        if source is None and jinja_path.exists():
            source, origin = read_text(jinja_path, "chat template", TemplateError), jinja_path
        special = {k: _token_text(config.get(k)) or "" for k in ("bos_token", "eos_token", "pad_token")}
        template = ChatTemplate(source, origin, special) if source else None
        return cls(folder / "tokenizer.json", config, template)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids, skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    enable_thinking: bool | None = None) -> str:
        """The conversation through the chat template; `enable_thinking` (Qwen3.x) goes into
        the template's context when set, else the template's default holds."""
        if self.chat_template is None:
            raise TemplateError("this model has no chat template (use raw completion)", self.path.parent)
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         **thinking_context(enable_thinking))

    def thinking_default(self) -> bool | None:
        """What the template does when `enable_thinking` is not given: True (thinks) or False;
        None when the template ignores the setting (or has none, or fails on a probe)."""
        if not hasattr(self, "_thinking_default"):
            self._thinking_default = self._probe_thinking()
        return self._thinking_default

    def dropped_tails(self) -> list[list[int]]:
        """Token runs that end a generation prompt but that the template does not render
        again once the reply is in the history (Qwen3's empty `<think></think>` with
        thinking off), one per thinking setting that has one: a chat keeps a state
        snapshot before them, where the next turn's ids part from this turn's."""
        if not hasattr(self, "_dropped_tails"):
            self._dropped_tails = self._probe_tails()
        return self._dropped_tails

    def _probe_tails(self) -> list[list[int]]:
        if self.chat_template is None:
            return []
        tails: list[list[int]] = []
        reply = THINKING_PROBE + [{"role": "assistant", "content": "!"}]
        for setting in (None, True, False):
            try:
                asked = self.encode(self.render_chat(THINKING_PROBE, True, setting))
                answered = self.encode(self.render_chat(reply, False, setting))
            except TemplateError:
                return []
            common = 0
            while common < min(len(asked), len(answered)) and asked[common] == answered[common]:
                common += 1
            tail = asked[common:]
            if 0 < len(tail) <= MAX_TAIL and tail not in tails:
                tails.append(tail)
        return tails

    def _probe_thinking(self) -> bool | None:
        if self.chat_template is None:
            return None
        try:
            unset, on, off = (self.render_chat(THINKING_PROBE, enable_thinking=v) for v in (None, True, False))
        except TemplateError:
            return None
        if on == off:
            return None
        return unset != off

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()
