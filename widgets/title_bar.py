"""A one-line title bar: icon, "title — sub-title", a right margin; it looks like Textual's Header.

The app's sub-title changes several times a second while a reply streams
(the token count). A title of one fixed line needs no layout pass when its
text changes, so this bar repaints only itself; built on public widgets only.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.events import Click
from textual.widget import Widget
from textual.widgets import Static


class TitleIcon(Static):
    """The icon at the left; a click opens the command palette."""

    DEFAULT_CSS = """
    TitleIcon {
        dock: left;
        padding: 0 1;
        width: 8;
        content-align: left middle;
    }
    TitleIcon:hover {
        background: $foreground 10%;
    }
    """

    def on_mount(self) -> None:
        self.tooltip = "Open the command palette"

    async def on_click(self, event: Click) -> None:
        event.stop()
        await self.run_action("app.command_palette")


class TitleText(Static):
    DEFAULT_CSS = """
    TitleText {
        text-wrap: nowrap;
        text-overflow: ellipsis;
        content-align: center middle;
        width: 100%;
    }
    """


class TitleMargin(Static):
    DEFAULT_CSS = """
    TitleMargin {
        dock: right;
        width: 10;
        padding: 0 1;
    }
    """


class TitleBar(Widget):
    DEFAULT_CSS = """
    TitleBar {
        dock: top;
        width: 100%;
        background: $panel;
        color: $foreground;
        height: 1;
    }
    """

    def __init__(self, icon: str = "⭘", **kwargs) -> None:
        super().__init__(**kwargs)
        self.icon = icon

    def compose(self) -> ComposeResult:
        yield TitleIcon(self.icon)
        yield TitleText()
        yield TitleMargin()

    def on_mount(self) -> None:
        self.watch(self.app, "title", self._show)
        self.watch(self.app, "sub_title", self._show)

    def _show(self) -> None:
        self.query_one(TitleText).update(self.app.format_title(self.app.title, self.app.sub_title), layout=False)
