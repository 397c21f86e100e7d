"""The presets picker (ctrl+g): load a knob preset, or save the current knobs under a name."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Static
from textual.widgets.option_list import Option

from tierlab.app.tui.presets import list_presets, preset_folder


class PresetScreen(ModalScreen):
    """The presets of the sessions folder; Enter loads the highlighted one, the name field saves."""

    DEFAULT_CSS = """
    PresetScreen { align: center middle; }
    PresetScreen > #preset-box {
        width: 76; max-width: 100%; height: auto; max-height: 100%;
        border: round $accent; background: $surface; padding: 0 1;
    }
    PresetScreen #preset-list { height: auto; max-height: 12; }
    PresetScreen #preset-status { color: $text-muted; height: auto; }
    """
    BINDINGS = [Binding("escape", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="preset-box") as box:
            box.border_title = "Knob presets"
            box.border_subtitle = "Enter loads · type a name to save · Esc closes"
            yield OptionList(id="preset-list")
            yield Input(placeholder="save the current knobs as… (a name, Enter saves)", id="preset-name")
            yield Static(id="preset-status")

    def on_mount(self) -> None:
        self.reload()
        self.query_one("#preset-list", OptionList).focus()

    def reload(self) -> None:
        folder = preset_folder(self.app.sessions_dir)  # type: ignore[attr-defined]
        try:
            presets, problems = list_presets(folder)
        except OSError as exc:
            presets, problems = [], [f"{folder}: {exc.strerror or exc}"]
        options = self.query_one("#preset-list", OptionList)
        options.clear_options()
        width = max((len(p.name) for p in presets), default=0)
        options.add_options([Option(f"{p.name:<{width}}  {p.assignments}", id=p.name) for p in presets])
        status = f"{folder}" + "".join(f"\n⚠ {line}" for line in problems)
        self.query_one("#preset-status", Static).update(status)
        for line in problems:
            self.app.notify(line, title="Preset", severity="warning")

    @on(OptionList.OptionSelected, "#preset-list")
    def load(self, event: OptionList.OptionSelected) -> None:
        if self.app.load_preset(str(event.option.id)):  # type: ignore[attr-defined]
            self.dismiss()

    @on(Input.Submitted, "#preset-name")
    def save(self, event: Input.Submitted) -> None:
        if self.app.save_preset(event.value):  # type: ignore[attr-defined]
            event.input.clear()
            self.reload()
