"""A chat template that behaves as Qwen3.x's does where tierlab cares: ChatML turns, a
past reply shown without its thinking, and the `enable_thinking` switch (thinking on
unless it is given as false)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

THINKING_OFF_BY_DEFAULT = THINKING_TEMPLATE.replace(
    "enable_thinking is defined and enable_thinking is false", "not (enable_thinking is defined and enable_thinking)")


def with_template(model: Path, out: Path, template: str) -> Path:
    """A copy of a model folder (weights linked, not copied) whose tokenizer_config.json
    carries `template`."""
    out.mkdir(parents=True)
    for item in model.iterdir():
        if item.name == "tokenizer_config.json":
            config = json.loads(item.read_text())
            config["chat_template"] = template
            (out / item.name).write_text(json.dumps(config))
        elif item.suffix == ".safetensors":
            (out / item.name).symlink_to(item.resolve())
        else:
            shutil.copy(item, out / item.name)
    return out
