"""The tierlab terminal app: chat with a tiered MoE while tuning its routing.

The engine runs in a worker thread; it reports every token to an
`EngineWatch`, and the UI reads that at its own pace (a tenth of a second),
so a fast engine never floods the screen and a slow one never freezes it.
Knob moves go straight to `engine.knobs`, which the engine reads at the
start of each token.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import Reactive
from textual.screen import Screen
from textual.widgets import Button, Footer

from tierlab.app.cli.errors import error_line
from tierlab.app.cli.signals import exit_on_sigterm
from tierlab.app.tui.chat import NO_TOKENIZER_HINT, ChatMessage, ChatPane, looks_like_code
from tierlab.app.tui.engine_watch import EngineWatch, format_knob_value
from tierlab.app.tui.keys import key_label, keys_for_action
from tierlab.app.tui.knob_panel import CACHE_SLOTS, KnobsPanel
from tierlab.app.tui.tools import TOOL_BINDINGS, AppTools
from tierlab.engine.conversation import Conversation
from tierlab.engine.errors import TierlabError
from tierlab.engine.knobs import SPEC_BY_NAME, KnobError
from tierlab.engine.meters import RECENT_TOKENS
from tierlab.engine.options import EngineOptions, first_run_slots
from tierlab.engine.surface import EngineSurface
from tierlab.widgets.heatmap import ExpertHeatmap, tier_names
from tierlab.widgets.knob import Knob, KnobSelect, KnobSwitch
from tierlab.widgets.meters import MeterPlot, MetersPanel, band_line
from tierlab.widgets.title_bar import TitleBar

VIEW_INTERVAL = 0.25
"""Seconds between redraws of heatmap and meters while tokens arrive (the engine needs the CPU more)."""
STREAM_INTERVAL = 0.25
"""Seconds between decodes of the reply text while it streams (the view tick shows the latest one)."""
SIDE_INTERVAL = 0.5
"""Seconds between redraws of heatmap, meter values and sub-title while a reply streams."""
PLOT_INTERVAL = 1.0
"""Seconds between redraws of the plot and the sparklines while a reply streams (the costly views); again at the end."""


def warm_oracle_kernels() -> None:
    """The oracle band replays Belady and LRU on its own thread while a reply streams; a first
    compile there would take the engine's CPU mid-reply, so the app compiles them while loading."""
    from tierlab.app.lab.belady import belady_hits, engine_lru_hits, lru_hits

    requests = [[0, 1], [1, 2], [0, 2]]
    belady_hits(requests, 2)
    lru_hits(requests, 2)
    engine_lru_hits(requests, 2, 3)  # the band's LRU figures at each size (oracle.py: OracleBand.reading)


def one_line(exc: BaseException) -> str:
    """An exception as the single line a notification can show, classified as the command
    line classifies it (bad input names the file or value; anything else is an internal error)."""
    return error_line(exc)


class TierlabApp(AppTools, App):
    """Chat, knobs, expert heatmap and meters on one screen."""

    TITLE = "tierlab"
    CSS_PATH = "tierlab.tcss"
    HORIZONTAL_BREAKPOINTS = [(0, "-tiny"), (100, "-narrow"), (140, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (40, "-tall")]

    sub_title: Reactive[str] = Reactive("", compute=False, repaint=False)
    """As in `App`, but without repainting the whole screen on each change: only the header shows it."""

    BINDINGS = [
        Binding("f1,question_mark", "help", "Help"),
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "toggle_recording", "Record"),
        Binding("r", "toggle_recording", "Record", show=False),
        Binding("f2", "heat_inspector", "Heat"),
        Binding("f3", "sessions", "Sessions"),
        Binding("f4", "save_heat", "Save heat", show=False),
        Binding("f5", "cycle_meter_window", "Meter window"),
        Binding("w", "cycle_meter_window", "Meter window", show=False),
        Binding("f6", "reset_knobs", "Reset knobs", show=False),
        Binding("ctrl+l", "clear_chat", "Clear"),
        Binding("ctrl+t", "toggle_raw", "Chat/raw", show=False),
        Binding("f7", "focus('heatmap')", "Heatmap", show=False),
        Binding("f8", "focus('knobs')", "Knobs", show=False),
        Binding("f9", "focus('prompt')", "Prompt", show=False),
        Binding("ctrl+q", "quit", "Quit"),
        *TOOL_BINDINGS,
        Binding("q", "quit", "Quit", show=False),
    ]

    def __init__(
        self,
        options: EngineOptions | None = None,
        *,
        engine_factory: Callable[[], EngineSurface] | None = None,
        sessions_dir: str | Path = "tierlab-sessions",
        seed: int = 0,
        max_tokens: int = 64,
        meter_window: int = RECENT_TOKENS,
        theme: str | None = None,
    ) -> None:
        super().__init__()
        self.max_tokens = max_tokens
        self.meter_window = meter_window
        self.start_theme = theme
        self.options = options
        self.model_dir = None if options is None else Path(options.model)
        self.engine_factory = engine_factory
        self.tier = options is not None and options.tier.enabled
        self.heat_path = None if options is None or not options.tier.heat_file else Path(options.tier.heat_file)
        self.sessions_dir = Path(sessions_dir)
        self.seed = seed
        self.engine: EngineSurface | None = None
        self.conversation: Conversation | None = None
        self.watch: EngineWatch | None = None
        self.recorder = None
        self.generating = False
        self.replies = 0
        self._stop_event = threading.Event()
        self._engine_idle = threading.Event()
        self._engine_idle.set()
        self._drawn_tokens = -1
        self._pending_text: tuple[ChatMessage, str] | None = None
        """The streaming reply's latest text, left by the engine thread for the next view tick."""
        self._plot_drawn_at = -PLOT_INTERVAL
        self._side_drawn_at = -SIDE_INTERVAL
        self._initial_slots = 0
        self._cache_lock = threading.Lock()
        self._cache_wanted: int | None = None
        """A RAM cache size chosen while the engine was busy, for the cache worker to apply."""
        self._cache_worker_running = False

    # -- layout --------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield TitleBar()
        with Horizontal(id="main"):
            yield ChatPane(id="chat")
            with Vertical(id="side"):
                yield ExpertHeatmap(id="heatmap")
                with Horizontal(id="lower"):
                    yield KnobsPanel(id="knobs")
                    with Vertical(id="meters-box"):
                        yield MetersPanel(id="meters")
                        yield MeterPlot(id="plot")
        yield Footer()

    def on_mount(self) -> None:
        self._remove_sigterm = exit_on_sigterm(lambda code: self.exit(return_code=code))  # unmount closes the engine
        if self.start_theme:
            if self.start_theme in self.available_themes:
                self.theme = self.start_theme
            else:
                names = ", ".join(sorted(self.available_themes))
                self.notify(f"no theme {self.start_theme!r}; themes: {names}", severity="warning", timeout=10)
        self._title_chat()
        self.query_one("#heatmap").border_title = "Experts"
        self.query_one("#knobs").border_title = "Knobs"
        self.query_one("#meters-box").border_title = "Meters"
        self.sub_title = "loading…"
        self.query_one(ExpertHeatmap).placeholder = f"loading {self.model_dir.name if self.model_dir else 'the model'}…"
        self.query_one("#max-tokens", Knob).set_value_quietly(self.max_tokens)
        self.query_one("#prompt").focus()
        self.set_interval(VIEW_INTERVAL, self._view_tick, name="views")
        self.load_engine()

    # -- engine --------------------------------------------------------------

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False)
    def load_engine(self) -> None:
        """Open the model without blocking the screen; the kernel warm-up's progress is shown
        in the loading placeholder and the sub-title. Without --cache the RAM cache starts
        smaller than the expert count (`first_run_slots`, and no more than the memory budget
        leaves), so the routing lever has work."""
        if self.engine_factory is None and self.options is None:
            self._call_ui(self._engine_failed, "no model: start with --model DIR")
            return
        try:
            if self.engine_factory is not None:
                engine = self.engine_factory()
            else:
                options = self.options
                if options.cache is None:
                    from tierlab.engine.config import load_config

                    config = load_config(Path(options.model))
                    slots = first_run_slots(config.n_experts, config.top_k)
                    plan = options.budget_plan(config)  # the memory budget caps the first-run cache too
                    if plan is not None:
                        slots = min(slots, plan.slots)
                    options = dataclasses.replace(options, cache=slots)
                engine = options.open(progress=self._loading_progress)
                self._call_ui(self._show_loading, "compiling kernels · the oracle's replays")
                warm_oracle_kernels()
        except Exception as exc:  # bad input, or an engine bug: either way the app stays up
            self._call_ui(self._engine_failed, one_line(exc))
            return
        self._call_ui(self._engine_ready, engine)

    def _loading_progress(self, done: int, total: int, label: str, compiled: int) -> None:
        """From the loading thread: the kernel warm-up's step, for the screen."""
        text = f"compiling kernels {done}/{total}" + (f" · {label}" if done < total else "")
        if compiled:
            text += f" · {compiled} compiled"
        self._call_ui(self._show_loading, text)

    def _show_loading(self, text: str) -> None:
        if self.engine is not None:
            return
        name = self.model_dir.name if self.model_dir else "the model"
        self.sub_title = f"loading {name}… {text}"
        heatmap = self.query_one(ExpertHeatmap)
        heatmap.placeholder = f"loading {name}… {text}"
        heatmap.refresh()

    def _engine_failed(self, message: str) -> None:
        self.sub_title = "no model"
        heatmap = self.query_one(ExpertHeatmap)
        heatmap.placeholder = f"no model: {message}"
        heatmap.refresh()
        self.notify(message, title="Model not loaded", severity="error", timeout=15)

    def _engine_ready(self, engine: EngineSurface) -> None:
        # The model, its kernels and the widget tree live as long as the app: leave them out of the
        # collector's full passes, which otherwise stop both threads for a visible pause while tokens stream.
        gc.freeze()
        self.engine = engine
        self.conversation = Conversation(engine)  # chat turns prefill only what the state lacks
        self.watch = EngineWatch(engine)
        self.watch.set_recent(self.meter_window)
        self._title_meters()
        config = engine.config
        slots = engine.cache_slots()
        self._initial_slots = slots
        self.query_one(KnobsPanel).configure(int(config.top_k), int(config.n_experts), slots)
        self.query_one(KnobsPanel).show(engine.knobs.snapshot(), slots)
        self.tools_engine_ready(engine)
        names = tier_names(engine.tier_description())
        self.query_one(ExpertHeatmap).tier = names
        self.query_one(MetersPanel).name_tier(names.meter)
        self.query_one(MeterPlot).tier_meter = names.meter
        self.refresh_views(force=True)
        self._update_subtitle()
        if self.tier and engine.tier_description() is None:
            self.notify("no GPU tier: running from RAM and disk only", severity="warning")
        tokenizer = engine.tokenizer
        if tokenizer is None:
            prompt = self.query_one("#prompt")
            prompt.placeholder = NO_TOKENIZER_HINT
            prompt.disabled = True
            self.notify("this model has no tokenizer.json: chat is off", severity="warning")
        elif getattr(tokenizer, "chat_template", True) is None:
            self.query_one(ChatPane).raw_mode = True
            self.notify("this model has no chat template: raw completion mode", severity="warning")
        else:
            self.query_one(ChatPane).offer_thinking(tokenizer.thinking_default())
        self._title_chat()
        self._show_engine_notices()

    def _show_engine_notices(self) -> None:
        notices = self.engine.notices
        while notices:
            self.notify(str(notices.pop(0)), title="engine")

    def _update_subtitle(self) -> None:
        if self.engine is None:
            return
        config = self.engine.config
        parts = [
            Path(self.engine.model_dir).name,
            f"{config.n_layers}L × {config.n_experts}E top-{config.top_k}",
            self._cache_text(),
        ]
        tier = self._tier_text()
        if tier:
            parts.append(tier)
        if self.watch is not None:
            parts.append(f"{self.watch.tokens_seen} tok")
        if self.generating:
            parts.append("generating…")
        if self.recorder is not None:
            parts.append("● REC")
        self.sub_title = " · ".join(parts)

    def _tier_text(self) -> str:
        """`GPU tier 96 experts` or `OpenCL CPU tier 96 experts` while a tier is attached; '' without."""
        report = self.engine.tier_description()
        if report is None:
            return ""
        return f"{tier_names(report).level} {report.get('capacity', 0)} experts"

    def _title_chat(self) -> None:
        """The chat pane's title says which mode the next prompt runs in."""
        chat = self.query_one(ChatPane)
        if self.engine is not None and self.engine.tokenizer is None:
            mode = "no tokenizer"
        else:
            mode = "raw mode" if chat.raw_mode else "chat mode"
        chat.border_title = f"Chat · {mode}"

    def _cache_text(self) -> str:
        """`cache 12/32 · 4.5 MiB`: RAM slots per layer of the expert count, and the RAM they
        take (slots × expert bytes × MoE layers); `→ 8` while a new size waits for the engine."""
        engine = self.engine
        config = engine.config
        slots = engine.cache_slots()
        stats = engine.store_stats()
        mib = slots * stats.blob_nbytes * sum(1 for moe in config.moe_layers if moe) / 2**20
        text = f"cache {slots}/{config.n_experts} · {mib:.3g} MiB"
        wanted = self._cache_wanted
        if wanted is not None and wanted != slots:
            text += f" → {wanted}"
        return text

    def _view_tick(self) -> None:
        """Everything that changes while a reply streams is drawn here, so it all lands in one frame."""
        pending, self._pending_text = self._pending_text, None
        if pending is not None:
            self._show_partial(*pending)
        self.refresh_views()

    def refresh_views(self, force: bool = False) -> None:
        """Redraw heatmap and meters if tokens arrived since the last redraw.

        While a reply streams they are redrawn every `SIDE_INTERVAL` (plot and sparklines every
        `PLOT_INTERVAL`), not at every view tick: each redraw takes CPU from the engine.
        """
        if self.watch is None:
            return
        seen = self.watch.tokens_seen
        now = time.monotonic()
        if not force and (seen == self._drawn_tokens or (self.generating and now - self._side_drawn_at < SIDE_INTERVAL)):
            return
        self._drawn_tokens = seen
        self._side_drawn_at = now
        data = self.overlay.heatmap_data(self.watch.heatmap_data())  # a token the overlay pinned, else the live one
        self.query_one(ExpertHeatmap).update_data(data, now=True)  # this tick is the throttle
        history = self.watch.meter_history()
        slow_views = force or not self.generating or now - self._plot_drawn_at >= PLOT_INTERVAL
        if slow_views:
            self._plot_drawn_at = now
        self.query_one(MetersPanel).show(history, sparklines=slow_views)
        reading = self.watch.oracle_reading()
        self.query_one("#meters-box").border_subtitle = band_line(reading.meters() if reading else None)
        plot = self.query_one(MeterPlot)
        if plot.display and slow_views:
            plot.show(history)
        self._update_subtitle()
        self._show_engine_notices()

    # -- chat ----------------------------------------------------------------

    @on(ChatPane.Submitted)
    def start_reply(self, event: ChatPane.Submitted) -> None:
        chat = self.query_one(ChatPane)
        if self.engine is None:
            self.notify("no model loaded", severity="error")
            return
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            self.notify("this model has no tokenizer: cannot chat", severity="error")
            return
        if self.generating:
            self.notify("still answering; Esc stops it", severity="warning")
            return
        if not chat.raw_mode and looks_like_code(event.text):
            self.notify("this looks like code: ^T (or the raw mode switch) completes it as plain text "
                        "instead of a chat turn", title="Chat mode", timeout=6)
        if chat.raw_mode:
            chat.add("user", event.text)
            self._begin_reply(event.text, chat.add("raw"))
        else:
            # The template renders off the UI thread (within its budget): the screen stays live.
            self.generating = True  # one turn at a time, also while its template renders
            self._stop_event = threading.Event()  # set by clearing the chat (or Esc): the turn is dropped
            self._update_subtitle()
            self.render_prompt(chat.messages + [{"role": "user", "content": event.text}], self._stop_event,
                               chat.thinking)

    @work(thread=True, exclusive=True, group="template", exit_on_error=False)
    def render_prompt(self, messages: list[dict], cleared: threading.Event, thinking: bool | None = None) -> None:
        """Render the chat template for the new turn; a template that fails is a notification."""
        try:
            prompt = self.engine.tokenizer.render_chat(messages, add_generation_prompt=True,
                                                       enable_thinking=thinking)
        except Exception as exc:  # a template that fails or runs past its budget must not take the app down
            self._call_ui(self._template_failed, one_line(exc))
            return
        self._call_ui(self._begin_chat_turn, messages[-1], prompt, cleared)

    def _template_failed(self, message: str) -> None:
        self.generating = False
        self._update_subtitle()
        self.notify(message, title="Chat template", severity="error")

    def _begin_chat_turn(self, message: dict, prompt: str, cleared: threading.Event) -> None:
        if cleared.is_set():  # the chat was cleared (or Esc pressed) while the template rendered
            self.generating = False
            self._update_subtitle()
            return
        chat = self.query_one(ChatPane)
        chat.messages.append(message)
        chat.add("user", message["content"])
        self._begin_reply(prompt, chat.add("assistant"))

    def _begin_reply(self, prompt: str, reply: ChatMessage) -> None:
        chat = self.query_one(ChatPane)
        reply.add_class("-streaming")
        self.generating = True
        self._stop_event = threading.Event()
        self._engine_idle.clear()
        self._update_subtitle()
        # The side panes are current: their first redraw can wait, as when the reply is under way.
        self._side_drawn_at = self._plot_drawn_at = time.monotonic()
        # The engine starts once the new turn is on screen: laying it out takes the UI tens of
        # milliseconds, which would otherwise be taken from the reply's first tokens.
        self.call_after_refresh(self.generate_reply, prompt, reply, chat.settings(), self._stop_event)

    @work(thread=True, exclusive=True, group="generate", exit_on_error=False)
    def generate_reply(self, prompt: str, reply: ChatMessage, settings: dict, stop: threading.Event) -> None:
        """Run the engine in this thread; leave text for the UI a few times a second.

        The text is only left for the next view tick: waiting for the UI (`call_from_thread`)
        would hold the engine up for as long as the screen takes to draw.
        """
        engine = self.engine
        tokenizer = engine.tokenizer
        produced: list[int] = []
        error: str | None = None
        last_shown = 0.0
        try:
            prompt_ids = tokenizer.encode(prompt)
            if not prompt_ids:
                raise TierlabError("the prompt encodes to no tokens")
            seed = self.seed + self.replies  # reproducible, yet a repeated prompt can sample differently
            for token in engine.generate(prompt_ids, seed=seed, stop_event=stop, conversation=self.conversation,
                                         **settings):
                produced.append(int(token))
                reply.tokens.append((int(token), self.overlay.ring.last_seq))  # the pass that produced it
                now = time.monotonic()
                if now - last_shown >= STREAM_INTERVAL:
                    last_shown = now
                    self._pending_text = (reply, tokenizer.decode(produced, skip_special=True))
        except Exception as exc:  # bad data or an engine bug ends this reply, not the app
            error = one_line(exc)
        text = tokenizer.decode(produced, skip_special=True) if produced else ""
        self._engine_idle.set()
        self._call_ui(self._finish_reply, reply, text, len(produced), stop.is_set(), error)

    def _call_ui(self, callback, *args) -> None:
        try:
            self.call_from_thread(callback, *args)
        except RuntimeError:  # the app is closing
            pass

    def _show_partial(self, reply: ChatMessage, text: str) -> None:
        if reply.set_text(text):  # a new line: keep it in view
            self.query_one(ChatPane).follow()

    def _finish_reply(self, reply: ChatMessage, text: str, n_tokens: int, stopped: bool, error: str | None) -> None:
        self._pending_text = None  # older than the final text
        self.generating = False
        self.replies += 1
        reply.remove_class("-streaming")
        reply.set_text(text + (" ⏹" if stopped else ""))
        chat = self.query_one(ChatPane)
        if reply.role == "assistant" and reply.is_attached:  # not when the chat was cleared meanwhile
            chat.messages.append({"role": "assistant", "content": text})
        chat.follow()
        self.overlay_reply_done(reply)
        if error:
            self.notify(error, title="Engine", severity="error")
        if self.watch is not None and self._engine_idle.is_set():
            try:
                self.watch.refresh_oracle()
            except Exception:  # the bound is a figure, not a reason to fail
                pass
        self.refresh_views(force=True)

    def action_cycle_meter_window(self) -> None:
        """Show the meters over the next window: last N tokens, since the knob change, since start."""
        if self.watch is None:
            return
        self.watch.cycle_window()
        self._title_meters()
        self.refresh_views(force=True)

    def _title_meters(self) -> None:
        """Name the meters' window in the meters box title."""
        title = "Meters" if self.watch is None else f"Meters · {self.watch.window_title()}"
        self.query_one("#meters-box").border_title = title

    def action_stop(self) -> None:
        """Stop the reply being generated (takes effect after the current token)."""
        if self.generating:
            self._stop_event.set()
            self.notify("stopping…", timeout=2)

    def action_clear_chat(self) -> None:
        """Forget the conversation (the engine keeps its caches and meters)."""
        self._stop_event.set()
        self.query_one(ChatPane).clear()
        if self.engine is not None and not self.generating:  # a running reply ends first; the next one starts afresh
            self.engine.reset()

    def action_toggle_raw(self) -> None:
        chat = self.query_one(ChatPane)
        chat.raw_mode = not chat.raw_mode
        self.notify("raw completion mode" if chat.raw_mode else "chat mode (chat template)", timeout=2)

    def action_toggle_thinking(self) -> None:
        thinking = self.query_one(ChatPane).toggle_thinking()
        if thinking is None:
            self.notify("this model's chat template has no thinking switch", severity="warning", timeout=3)
        else:
            self.notify(f"thinking {'on' if thinking else 'off'} from the next turn", timeout=2)

    # -- knobs ---------------------------------------------------------------

    def set_engine_knob(self, name: str, value: object) -> None:
        """Hand one knob to the engine; it applies from the next token."""
        if self.engine is None:
            return
        try:
            self.engine.knobs.set(name, value)
        except KnobError as exc:
            self.notify(one_line(exc), title="Knob", severity="warning")
            self.query_one(KnobsPanel).show(self.engine.knobs.snapshot())

    def set_cache_slots(self, slots: int) -> None:
        """Resize the RAM cache without waiting on the engine: with no reply running it applies
        now; during a reply a worker thread applies it between two tokens (the latest size
        wins), while the knob and the sub-title show the size on its way."""
        if self.engine is None:
            return
        slots = int(slots)
        if self._engine_idle.is_set() and not self._cache_worker_running:
            self._apply_cache_now(slots)
            return
        with self._cache_lock:
            self._cache_wanted = slots
            start = not self._cache_worker_running
            self._cache_worker_running = True
        if start:
            self._cache_worker()
        self._update_subtitle()

    def _apply_cache_now(self, slots: int) -> None:
        old = self.engine.cache_slots()
        try:
            self.engine.set_cache_slots(slots)
        except Exception as exc:  # a size the engine refuses, or an engine bug: a notice
            self._cache_applied(old, slots, one_line(exc))
        else:
            self._cache_applied(old, slots, None)

    @work(thread=True, group="cache", exit_on_error=False)
    def _cache_worker(self) -> None:
        """Apply the wanted RAM cache size; the engine takes it between two tokens."""
        engine = self.engine
        while True:
            with self._cache_lock:
                slots = self._cache_wanted
                if slots is None:
                    self._cache_worker_running = False
                    return
            old = engine.cache_slots()
            error = None
            try:
                engine.set_cache_slots(slots)
            except Exception as exc:  # a size the engine refuses, or an engine bug: a notice
                error = one_line(exc)
            with self._cache_lock:
                if self._cache_wanted == slots:
                    self._cache_wanted = None
            self._call_ui(self._cache_applied, old, slots, error)

    def _cache_applied(self, old: int, slots: int, error: str | None) -> None:
        if error is not None:
            self.notify(error, title="RAM cache", severity="warning")
            self.query_one(KnobsPanel).show(self.engine.knobs.snapshot(), self.engine.cache_slots())
        elif slots != old:
            if self.watch is not None:
                self.watch.mark(f"cache={slots}")
            if self.recorder is not None:
                self.recorder.note_setting("cache_slots", old, slots)
        self._update_subtitle()

    def on_knob_changed(self, event: Knob.Changed) -> None:
        if event.knob_name in SPEC_BY_NAME:
            self.set_engine_knob(event.knob_name, event.value)
        elif event.knob_name == CACHE_SLOTS:
            self.set_cache_slots(int(event.value))

    def on_knob_switch_changed(self, event: KnobSwitch.Changed) -> None:
        if event.knob_name == "raw mode":
            self._title_chat()
        elif event.knob_name == "ROUTE_AGREE":
            self.set_engine_knob("ROUTE_AGREE", "1" if event.value else "auto")
        elif event.knob_name in SPEC_BY_NAME:
            self.set_engine_knob(event.knob_name, event.value)

    def on_knob_select_changed(self, event: KnobSelect.Changed) -> None:
        if event.knob_name in SPEC_BY_NAME:
            self.set_engine_knob(event.knob_name, event.value)

    @on(Button.Pressed, "#reset-knobs")
    def action_reset_knobs(self) -> None:
        """Every routing knob back to its default, and the RAM cache to its starting size."""
        if self.engine is None:
            return
        changes = self.engine.knobs.reset()
        if self.engine.cache_slots() != self._initial_slots:
            self.set_cache_slots(self._initial_slots)
        self.query_one(KnobsPanel).show(self.engine.knobs.snapshot(), self._initial_slots)
        names = ", ".join(f"{c.name}={format_knob_value(c.new)}" for c in changes) or "nothing to reset"
        self.notify(names, title="Knobs reset", timeout=3)

    # -- screens and files ---------------------------------------------------

    def action_help(self) -> None:
        from tierlab.app.tui.help_screen import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_heat_inspector(self) -> None:
        """The one heat inspector: opened again, it still holds the profiles it had."""
        from tierlab.app.tui.heat_screen import HeatInspector

        if not self.is_screen_installed("heat-inspector"):
            self.install_screen(HeatInspector(initial=self.heat_path), "heat-inspector")
        if not isinstance(self.screen, HeatInspector):
            self.push_screen("heat-inspector")

    def action_sessions(self) -> None:
        from tierlab.app.tui.sessions_screen import SessionsScreen

        if not isinstance(self.screen, SessionsScreen):
            self.push_screen(SessionsScreen())

    def action_save_heat(self, path: str | Path | None = None) -> Path | None:
        """Write this session's routing counts as a heat profile (docs/formats.md)."""
        from tierlab.app.tui.files import save_session_heat

        if self.engine is None:
            self.notify("no model loaded", severity="error")
            return None
        try:
            written = save_session_heat(self.engine, path, self.sessions_dir)
        except Exception as exc:  # a file that cannot be written: a notice
            self.notify(one_line(exc), title="Save heat", severity="error")
            return None
        self.notify(str(written), title="Heat profile saved", timeout=4)
        return written

    def action_toggle_recording(self) -> None:
        """Start or stop writing a session log of every token and knob change."""
        from tierlab.app.tui.recording import start_recording

        if self.engine is None or self.watch is None:
            self.notify("no model loaded", severity="error")
            return
        if self.recorder is not None:
            recorder, self.recorder = self.recorder, None
            try:
                path = recorder.stop()
            except Exception as exc:  # a file that cannot be written: a notice
                self.notify(one_line(exc), title="Recording", severity="error")
            else:
                self.notify(str(path), title="Session log saved", timeout=4)
        else:
            try:
                self.recorder = start_recording(self.engine, self.sessions_dir)
            except Exception as exc:  # a file that cannot be written: a notice
                self.notify(one_line(exc), title="Recording", severity="error")
                return
            self.notify(str(self.recorder.path), title="Recording", timeout=3)
        self._update_subtitle()

    # -- command palette -------------------------------------------------------

    def get_key_display(self, binding: Binding) -> str:
        """Keys in one style in the footer and everywhere else (app/tui/keys.py)."""
        return binding.key_display or key_label(binding.key)

    def _command(self, title: str, help: str, callback, action: str | None = None) -> SystemCommand:
        """A palette command whose help names its key, when it has one."""
        keys = keys_for_action(self.BINDINGS, action) if action else ""
        return SystemCommand(title, f"{help} · key {keys}" if keys else help, callback)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for command in super().get_system_commands(screen):
            if command.title == "Quit":
                command = command._replace(help=f"{command.help} · key {keys_for_action(self.BINDINGS, 'quit')}")
            yield command
        yield self._command("Help: keys and panes", "Show every key binding", self.action_help, "help")
        yield self._command("Stop generation", "Stop the reply after the current token", self.action_stop, "stop")
        yield self._command("Clear conversation", "Forget the chat and the sequence state", self.action_clear_chat,
                            "clear_chat")
        yield self._command("Toggle chat / raw completion", "Chat template or plain text completion",
                            self.action_toggle_raw, "toggle_raw")
        yield SystemCommand("Toggle thinking", "The chat template's enable_thinking (Qwen3.x), from the next turn",
                            self.action_toggle_thinking)
        yield self._command("Toggle recording", "Start or stop a session log", self.action_toggle_recording,
                            "toggle_recording")
        yield self._command("Reset knobs to defaults", "All routing knobs and the RAM cache size",
                            self.action_reset_knobs, "reset_knobs")
        yield self._command("Heat profile inspector", "Open, compare and save heat profiles",
                            self.action_heat_inspector, "heat_inspector")
        yield self._command("Sessions and A/B", "Recorded session logs and A/B tables", self.action_sessions,
                            "sessions")
        yield self._command("Save session heat", "Write this session's routing counts", self.action_save_heat,
                            "save_heat")
        yield self._command("Meter window: next", "Last N tokens, since the knob change, since start",
                            self.action_cycle_meter_window, "cycle_meter_window")
        yield SystemCommand("Heatmap: next view", "Residency, heat, this token, swaps · key m (heatmap)",
                            self._cycle_heatmap_mode)
        yield SystemCommand("Heatmap: fold / scroll", "How experts beyond the width are shown · key f (heatmap)",
                            self._cycle_heatmap_fold)
        yield SystemCommand("Toggle CACHE_ROUTE", "Cache-aware routing on/off (from the next token)",
                            lambda: self._toggle_knob("CACHE_ROUTE"))
        for mode in SPEC_BY_NAME["ROUTE_MODE"].choices or ():
            yield SystemCommand(f"ROUTE_MODE = {mode}", "Routing strategy (from the next token)",
                                lambda m=mode: self._set_knob_from_command("ROUTE_MODE", m))
        for name in ("heatmap", "knobs", "prompt"):
            yield self._command(f"Focus {name}", f"Move the keyboard focus to the {name}",
                                lambda n=name: self.action_focus(n), f"focus('{name}')")

    def _toggle_knob(self, name: str) -> None:
        if self.engine is not None:
            self._set_knob_from_command(name, not self.engine.knobs.get(name))

    def _set_knob_from_command(self, name: str, value: object) -> None:
        """A knob set from the palette: to the engine, then shown on the panel."""
        if self.engine is None:
            self.notify("no model loaded", severity="error")
            return
        self.set_engine_knob(name, value)
        self.query_one(KnobsPanel).show(self.engine.knobs.snapshot())

    def _cycle_heatmap_mode(self) -> None:
        self.query_one(ExpertHeatmap).action_cycle_mode()

    def _cycle_heatmap_fold(self) -> None:
        self.query_one(ExpertHeatmap).action_cycle_fold()

    def action_focus(self, widget_id: str) -> None:
        target = self.query_one(f"#{widget_id}")
        if widget_id == "knobs":
            knobs = list(target.query("Switch, Select, Knob"))
            if knobs:
                knobs[0].focus()
            return
        target.focus()

    # -- shutdown -----------------------------------------------------------------

    def on_unmount(self) -> None:
        getattr(self, "_remove_sigterm", lambda: None)()
        self._stop_event.set()
        if self.recorder is not None:
            try:
                self.recorder.stop()
            except Exception:
                pass
            self.recorder = None
        if self.watch is not None:
            self.watch.close()
        if self.engine is not None and self._engine_idle.wait(timeout=10):
            try:
                self.engine.close()  # writes the --heat profile, releases files and the device
            except Exception:
                pass
