"""The chat pane: the conversation, the prompt and the sampling settings.

It only holds and shows the conversation; generating the reply is the app's
job, so the pane never touches the engine.
"""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Input, Static

from tierlab.widgets.knob import Knob, KnobSwitch


PROMPT_HINT = "Ask something… (Enter sends, Esc stops, ? help)"
NO_TOKENIZER_HINT = "no tokenizer.json: this model cannot chat (the heatmap and knobs still work)"

CODE_STARTS = ("def ", "class ", "import ", "from ", "#include", "fn ", "function ", "package ", "public ", "<?php")
CODE_MARKS = ("```", "):\n", ") {", "};", "=>", "</")


def looks_like_code(text: str) -> bool:
    """Is a prompt source code to be continued, which chat mode would answer in prose?"""
    stripped = text.lstrip()
    return stripped.startswith(CODE_STARTS) or any(mark in text for mark in CODE_MARKS)


GROW_LINES = 6
"""Lines a streaming reply grows by when its text needs more room."""


class ChatMessage(Static):
    """One turn: the user's prompt, the model's reply (growing while it streams) or a note."""

    DEFAULT_CSS = """
    ChatMessage { margin: 0 0 1 0; padding: 0 1; }
    ChatMessage.-user { background: $boost; color: $text; border-left: thick $primary; }
    ChatMessage.-assistant { border-left: thick $success; }
    ChatMessage.-raw { border-left: thick $warning; }
    ChatMessage.-note { color: $text-muted; text-style: italic; }
    ChatMessage.-streaming { border-left: thick $accent; }
    """

    def __init__(self, role: str, text: str = "") -> None:
        super().__init__(text, markup=False, classes=f"-{role}")
        self.role = role
        self.text = text
        self.tokens: list[tuple[int, int]] = []
        """A reply's (token id, pass that produced it) pairs, for the token overlay (app/tui/overlay.py)."""

    def show_overlay(self, text: Text | None) -> None:
        """Show the reply in the token overlay's colours (None: its plain text again); the text is the same."""
        self.update(text if text is not None else (self.text or "…"), layout=False)

    def set_text(self, text: str) -> bool:
        """Show `text`; True when it changed the message's height (and so the screen's layout).

        A layout costs far more than a repaint (Textual lays the whole screen out, twice when a
        widget changes size), so a streaming reply repaints in place while its text fits, and
        when it needs more lines it takes `GROW_LINES` at once: a few blank lines at its end
        while it streams, instead of a layout for every new line.
        """
        self.text = text
        self.update(text if text else "…", layout=False)
        width = self.content_size.width
        if not self.is_mounted or not width:
            self.refresh(layout=True)
            return True
        needed = self.get_content_height(self.content_size, self.content_size, width)
        if not self.has_class("-streaming"):
            if self.styles.min_height is not None:
                self.styles.min_height = None  # lays out
                return True
            if needed != self.content_size.height:
                self.refresh(layout=True)
                return True
            return False
        if needed > self.content_size.height:
            self.styles.min_height = needed + GROW_LINES - 1  # lays out
            return True
        return False


PANE_KEYS = ("?", "q")
"""Keys that act as the app's keys (help, quit) while the prompt is empty, as in htop or k9s."""


class PromptInput(Input):
    """The prompt: `?` and `q` type only into a prompt that already has text; on an empty
    prompt they reach the app's bindings (help, quit)."""

    def check_consume_key(self, key: str, character: str | None) -> bool:
        if character in PANE_KEYS and not self.value:
            return False
        return super().check_consume_key(key, character)

    def on_key(self, event: events.Key) -> None:
        if event.character in PANE_KEYS and not self.value:
            event.prevent_default()  # not typed: the key goes on to the app's bindings


class ChatPane(Vertical):
    """Conversation, prompt input and generation settings."""

    DEFAULT_CSS = """
    ChatPane #conversation { height: 1fr; }
    ChatPane #chat-settings { height: auto; }
    ChatPane #chat-settings > Knob { width: 1fr; }
    ChatPane #prompt { dock: bottom; }
    """

    class Submitted(Message):
        """The user sent a prompt."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.messages: list[dict[str, str]] = []
        """The conversation as chat-template messages (chat mode only)."""

    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="conversation")
        with Vertical(id="chat-settings"):
            yield Knob("temperature", 0.0, 2.0, value=0.0, default=0.0, step=0.05, big_step=0.25, id="temperature",
                       help="0 = greedy decoding")
            yield Knob("top-p", 0.0, 1.0, value=1.0, default=1.0, step=0.01, big_step=0.1, id="top-p",
                       help="nucleus sampling mass (1 = off)")
            yield Knob("max tokens", 1, 512, value=64, default=64, integer=True, step=1, big_step=32, id="max-tokens",
                       help="stop the reply after this many new tokens")
            yield KnobSwitch("raw mode", False, default=False, id="raw-mode",
                             help="complete the prompt as plain text instead of a chat turn")
            thinking = KnobSwitch("thinking", True, default=True, id="thinking",
                                  help="the chat template's enable_thinking (Qwen3.x)")
            thinking.display = False  # shown once the model's template turns out to have the switch
            yield thinking
        yield PromptInput(placeholder=PROMPT_HINT, id="prompt")

    @property
    def raw_mode(self) -> bool:
        return self.query_one("#raw-mode", KnobSwitch).value

    @raw_mode.setter
    def raw_mode(self, value: bool) -> None:
        self.query_one("#raw-mode", KnobSwitch).value = value

    def offer_thinking(self, default: bool | None) -> None:
        """Show the thinking switch at the template's default; None (no switch in the
        template) hides it."""
        switch = self.query_one("#thinking", KnobSwitch)
        switch.display = default is not None
        if default is not None:
            switch.default = default
            switch.set_value_quietly(default)

    @property
    def thinking(self) -> bool | None:
        """`enable_thinking` for the next turn; None when the template has no such switch."""
        switch = self.query_one("#thinking", KnobSwitch)
        return switch.value if switch.display else None

    def toggle_thinking(self) -> bool | None:
        switch = self.query_one("#thinking", KnobSwitch)
        if switch.display:
            switch.value = not switch.value
        return self.thinking

    def settings(self) -> dict[str, float | int]:
        """Sampling settings for the next reply."""
        return {
            "temperature": float(self.query_one("#temperature", Knob).value),
            "top_p": float(self.query_one("#top-p", Knob).value),
            "max_new_tokens": int(self.query_one("#max-tokens", Knob).value),
        }

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        if text:
            event.input.clear()
            self.post_message(self.Submitted(text))

    def add(self, role: str, text: str = "") -> ChatMessage:
        """Show a new turn at the end and keep it in view."""
        message = ChatMessage(role, text)
        conversation = self.query_one("#conversation", VerticalScroll)
        conversation.mount(message)
        message.set_text(text)
        conversation.scroll_end(animate=False)
        return message

    def follow(self) -> None:
        """Keep the newest text in view while it streams."""
        self.query_one("#conversation", VerticalScroll).scroll_end(animate=False)

    def clear(self) -> None:
        self.messages.clear()
        self.query_one("#conversation", VerticalScroll).remove_children()
