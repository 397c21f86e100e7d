"""One way of writing keys everywhere the app names them: footer, help, command palette.

Function keys and named keys are capitalised (`F2`, `Esc`, `PgUp`), control
keys are a caret and a capital (`^R`), arrows are arrows (`←`), printable
keys are themselves (`q`, `?`).
"""

from __future__ import annotations

from typing import Iterable

from textual.binding import Binding

NAMED = {
    "escape": "Esc", "enter": "Enter", "tab": "Tab", "space": "Space", "delete": "Del", "backspace": "Bksp",
    "pageup": "PgUp", "pagedown": "PgDn", "home": "Home", "end": "End",
    "left": "←", "right": "→", "up": "↑", "down": "↓", "question_mark": "?",
}


def key_label(key: str) -> str:
    """`ctrl+r` -> `^R`, `f2` -> `F2`, `escape` -> `Esc`, `left` -> `←`, `q` -> `q`."""
    *modifiers, name = key.strip().split("+")
    if name.startswith("f") and name[1:].isdigit():
        label = name.upper()
    else:
        label = NAMED.get(name, name)
    if "ctrl" in modifiers:
        return "^" + label.upper()
    if "shift" in modifiers:
        return "Shift+" + label
    return label


def binding_keys(binding: Binding) -> str:
    """Every key of a binding, in the one style: `F1 / ?`."""
    return " / ".join(key_label(key) for key in binding.key.split(","))


def keys_for_action(bindings: Iterable[Binding], action: str) -> str:
    """The keys bound to `action`, in the one style ('' when none)."""
    labels: list[str] = []
    for binding in bindings:
        if binding.action == action:
            for key in binding.key.split(","):
                label = key_label(key)
                if label not in labels:
                    labels.append(label)
    return " / ".join(labels)
