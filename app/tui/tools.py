"""The app's tools beside chat and knobs: layer drill-down, token overlay, presets and exports.

`AppTools` is mixed into `TierlabApp`: it holds the actions behind
`TOOL_BINDINGS` and the palette's commands for them, and delegates the work
to drilldown.py, overlay.py, presets.py and exports.py. The app calls
`tools_engine_ready` once the engine is open and `overlay_reply_done` when
a reply ends.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Iterable

from textual import events
from textual.app import SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from tierlab.app.cli.errors import error_line
from tierlab.app.tui.chat import ChatMessage, ChatPane
from tierlab.app.tui.overlay import MEASURE_TITLES, MEASURES, TokenOverlay
from tierlab.widgets.heatmap import ExpertHeatmap

TOOL_BINDINGS = [
    Binding("enter", "drill_down", "Layer detail", show=False),
    Binding("ctrl+o", "cycle_overlay", "Token overlay", show=False),
    Binding("ctrl+g", "presets", "Knob presets", show=False),
    Binding("ctrl+s", "screenshot", "Screenshot", show=False),
    Binding("ctrl+y", "copy_reply", "Copy reply", show=False),
]
"""The tools' keys (Enter: on the heatmap, for the cursor's layer)."""


class AppTools:
    """Drill-down, overlay, presets and exports for `TierlabApp` (which provides engine, watch, notify…)."""

    @cached_property
    def overlay(self) -> TokenOverlay:
        return TokenOverlay()

    def tools_engine_ready(self, engine) -> None:
        """Start keeping per-token routes for the overlay."""
        self.overlay.ring.attach(engine)

    def on_unmount(self) -> None:
        self.overlay.ring.detach()

    # -- layer drill-down ---------------------------------------------------------

    def main_screen(self) -> Screen:
        """The screen of chat, heatmap and knobs, also while a modal screen is on top of it."""
        return self.screen_stack[0]

    def action_drill_down(self, layer: int | None = None) -> None:
        """Open the drill-down for `layer` (default: the heatmap cursor's, when the heatmap has focus)."""
        from tierlab.app.tui.drilldown import open_on

        screen = self.main_screen()
        heatmap = screen.query_one(ExpertHeatmap)
        if layer is None:
            if self.focused is not heatmap:
                return
            layer = heatmap.cursor[0]
        if self.engine is None:
            self.notify("no model loaded", severity="error")
            return
        open_on(screen, int(layer))

    def on_click(self, event: events.Click) -> None:
        """A double click on a heatmap cell opens that layer's drill-down (the first click moved the cursor)."""
        if event.chain == 2 and isinstance(event.widget, ExpertHeatmap) and event.widget.id == "heatmap":
            self.action_drill_down(event.widget.cursor[0])

    # -- token overlay ------------------------------------------------------------

    def action_cycle_overlay(self) -> None:
        """Colour the replies' tokens by the next measure (misses, swaps, KL, then off)."""
        measure = self.overlay.cycle()
        self.paint_overlay()
        self.refresh_views(force=True)
        self.notify(f"token overlay: {MEASURE_TITLES[measure]}" if measure else "token overlay off", timeout=2)

    def set_overlay(self, measure: str | None) -> None:
        while self.overlay.measure != measure:
            self.overlay.cycle()
        self.paint_overlay()
        self.refresh_views(force=True)

    def overlay_messages(self) -> list[ChatMessage]:
        chat = self.main_screen().query_one(ChatPane)
        return [m for m in chat.query(ChatMessage) if m.tokens and not m.has_class("-streaming")]

    def paint_overlay(self) -> None:
        """Show every finished reply in the overlay's colours (or plain again), with its legend."""
        overlay = self.overlay
        chat = self.main_screen().query_one(ChatPane)
        messages = self.overlay_messages()
        if overlay.measure is None or self.engine is None or self.engine.tokenizer is None:
            for message in messages:
                message.show_overlay(None)
            if overlay.saved_subtitle is not None:
                chat.border_subtitle, overlay.saved_subtitle = overlay.saved_subtitle, None
            self._show_pinned()
            return
        if overlay.saved_subtitle is None:
            overlay.saved_subtitle = str(chat.border_subtitle or "")
        top = overlay.top(messages)
        for message in messages:
            message.show_overlay(overlay.render(message, self.engine.tokenizer, top))
        chat.border_subtitle = overlay.legend(top)
        self._show_pinned()

    def overlay_reply_done(self, reply: ChatMessage) -> None:
        if self.overlay.measure is not None:
            self.paint_overlay()

    def action_select_token(self, seq: int) -> None:
        """Pin token `seq`'s routes in the heatmap (its own token view); the same token again unpins."""
        overlay = self.overlay
        heatmap = self.main_screen().query_one(ExpertHeatmap)
        if overlay.pinned == seq or overlay.ring.get(seq) is None:
            overlay.pinned = None
        else:
            overlay.pinned = seq
            heatmap.mode = "token"
        self.paint_overlay()
        self.refresh_views(force=True)

    def _show_pinned(self) -> None:
        heatmap = self.main_screen().query_one(ExpertHeatmap)
        overlay = self.overlay
        pinned = overlay.pinned
        if pinned is None:
            if overlay.saved_title is not None:
                heatmap.border_title, overlay.saved_title = overlay.saved_title, None
            return
        if overlay.saved_title is None:
            overlay.saved_title = str(heatmap.border_title or "")
        token_id = next((t for m in self.overlay_messages() for t, s in m.tokens if s == pinned), -1)
        tokenizer = self.engine.tokenizer if self.engine is not None else None
        heatmap.border_title = f"{overlay.saved_title} · {overlay.describe(pinned, token_id, tokenizer)}"

    # -- presets ------------------------------------------------------------------

    def action_presets(self) -> None:
        from tierlab.app.tui.preset_screen import PresetScreen

        if self.engine is None:
            self.notify("no model loaded", severity="error")
            return
        if not isinstance(self.screen, PresetScreen):
            self.push_screen(PresetScreen())

    def load_preset(self, name: str) -> bool:
        """Set every knob from preset `name` (from the next token); a bad preset is a notification."""
        from tierlab.app.tui.knob_panel import KnobsPanel
        from tierlab.app.tui.presets import apply_preset, find_preset, preset_folder

        if self.engine is None:
            self.notify("no model loaded", severity="error")
            return False
        try:
            preset = find_preset(preset_folder(self.sessions_dir), name)
            apply_preset(self.engine.knobs, preset)
        except Exception as exc:  # a bad file or a value the engine refuses: a notice, the app stays up
            self.notify(error_line(exc), title="Preset", severity="error")
            return False
        self.main_screen().query_one(KnobsPanel).show(self.engine.knobs.snapshot())
        self.notify(f"{preset.name}: {preset.assignments}", title="Preset loaded", timeout=3)
        return True

    def save_preset(self, name: str) -> bool:
        """Save the engine's knobs as preset `name` in the sessions folder."""
        from tierlab.app.tui.presets import preset_folder, write_preset

        if self.engine is None:
            self.notify("no model loaded", severity="error")
            return False
        try:
            path = write_preset(preset_folder(self.sessions_dir), name, self.engine.knobs.snapshot())
        except Exception as exc:  # a bad name or a file that cannot be written: a notice
            self.notify(error_line(exc), title="Preset", severity="error")
            return False
        self.notify(str(path), title="Preset saved", timeout=3)
        return True

    # -- exports ----------------------------------------------------------------------

    def deliver_screenshot(self, filename: str | None = None, path: str | None = None,
                           time_format: str | None = None) -> str | None:
        """Textual's screenshot, into the sessions folder unless told otherwise (never ~/Downloads)."""
        from tierlab.app.tui.exports import screenshot_name

        folder = Path(path) if path else Path(self.sessions_dir)
        try:
            name = filename or screenshot_name(folder)
        except OSError as exc:
            self.notify(f"{folder}: {exc.strerror or exc}", title="Screenshot", severity="error")
            return None
        return super().deliver_screenshot(name, str(folder), time_format)  # type: ignore[misc]

    def action_export_meters(self) -> Path | None:
        """Write this session's meters as CSV into the sessions folder."""
        from tierlab.app.tui.exports import save_meters_csv

        if self.watch is None:
            self.notify("no model loaded", severity="error")
            return None
        try:
            path = save_meters_csv(self.watch, Path(self.sessions_dir))
        except Exception as exc:  # a file that cannot be written: a notice
            self.notify(error_line(exc), title="Meters CSV", severity="error")
            return None
        self.notify(str(path), title="Meters saved", timeout=4)
        return path

    def action_copy_reply(self) -> str | None:
        """Copy the last reply to the clipboard through OSC 52."""
        from tierlab.app.tui.exports import last_reply

        text = last_reply(self.main_screen().query_one(ChatPane))
        if text is None:
            self.notify("no reply to copy yet", severity="warning")
            return None
        self.copy_to_clipboard(text)
        self.notify(f"copied the last reply ({len(text)} characters) to the clipboard via OSC 52, "
                    "where the terminal allows it", title="Copy", timeout=4)
        return text

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        from tierlab.app.tui.sessions_screen import SessionsScreen

        yield from super().get_system_commands(screen)  # type: ignore[misc]
        if isinstance(screen, SessionsScreen):
            yield SystemCommand("Export A/B table as markdown", "The A/B table into the sessions folder (e)",
                                screen.action_export)
        yield SystemCommand("Layer drill-down", "The heatmap cursor's layer up close (Enter on the heatmap)",
                            lambda: self.action_drill_down(self.main_screen().query_one(ExpertHeatmap).cursor[0]))
        yield SystemCommand("Token overlay: next measure", "Colour tokens by misses, swaps, KL, then off (ctrl+o)",
                            self.action_cycle_overlay)
        for measure in (*MEASURES, None):
            title = MEASURE_TITLES[measure] if measure else "off"
            yield SystemCommand(f"Token overlay: {title}", "Colour each generated token by this measure",
                                lambda m=measure: self.set_overlay(m))
        yield SystemCommand("Presets: load or save", "Knob presets in the sessions folder (ctrl+g)",
                            self.action_presets)
        for name in ("stock", "recommended", "aggressive"):
            yield SystemCommand(f"Preset: {name}", "Set every knob from this preset",
                                lambda n=name: self.load_preset(n))
        yield SystemCommand("Export meters as CSV", "This session's meters into the sessions folder",
                            self.action_export_meters)
        yield SystemCommand("Export screenshot (SVG)", "The screen into the sessions folder (ctrl+s)",
                            lambda: self.deliver_screenshot())
        yield SystemCommand("Copy last reply", "To the clipboard via OSC 52 (ctrl+y)", self.action_copy_reply)
