"""A chat whose turns reuse the sequence state instead of prefilling it again.

Each turn renders the whole conversation; what the engine already holds (the
attention KV caches and DeltaNet states of the turns so far) is kept for the
longest common prefix of token ids, and only the rest is prefilled. A KV
cache cuts back to any prefix. A DeltaNet state cannot be rolled back, so
the conversation keeps copies of the sequence state at each turn's prompt
end and generation end, and before a prompt's tail that the template does not
render again once the reply is in the history (Qwen3's empty
`<think></think>` with thinking off; `Tokenizer.dropped_tails`): when a
template renders an earlier turn differently (Qwen3 also drops a past reply's
thinking), the latest copy at or before the common prefix is restored and the
prefill starts there. Nothing in common, or
a cleared conversation (`forget`), is a full prefill.
"""

from __future__ import annotations

import threading
from typing import Iterator

import numpy as np

from tierlab.engine.surface import EngineSurface

KEEP_SNAPSHOTS = 3
"""Copies kept: the last turn's prompt end, generation end, and the point before a tail
of its prompt that the next turn does not repeat (each copy one set of DeltaNet states)."""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Conversation:
    def __init__(self, engine: EngineSurface, keep: int = KEEP_SNAPSHOTS) -> None:
        self.engine = engine
        self.keep = keep
        self.snapshots: list = []
        self.reused = 0  # tokens of the last prompt taken from the state
        self.prefilled = 0  # tokens of the last prompt fed
        tokenizer = engine.tokenizer
        self.tails = tokenizer.dropped_tails() if tokenizer is not None else []

    def forget(self) -> None:
        """Clear the conversation: the next turn is a full prefill."""
        self.engine.reset()
        self.snapshots = []

    def prefill(self, ids) -> np.ndarray:
        """Bring the sequence to `ids`, feeding only what the state does not hold; the
        next-token logits."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("prefill needs at least one token")
        engine = self.engine
        start = self._resume(ids)
        if start == 0:
            self.snapshots = []
            engine.reset()
        at = start
        for mark in self._marks(ids, start):  # a snapshot before a tail the next turn will not repeat
            engine.forward(ids[at:mark], phase="prefill")
            self._remember()
            at = mark
        logits = engine.forward(ids[at:], phase="prefill")
        self.reused, self.prefilled = start, len(ids) - start
        self._remember()
        return logits

    def _marks(self, ids: list[int], start: int) -> list[int]:
        marks = {len(ids) - len(tail) for tail in self.tails if ids[len(ids) - len(tail):] == tail}
        return sorted(m for m in marks if start < m < len(ids))

    def generate(self, prompt_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, stop_event: threading.Event | None = None, eos_ids=None) -> Iterator[int]:
        """`Engine.generate` for the next turn: the same tokens, with the prompt prefilled
        from what the conversation already holds."""
        logits = self.prefill(prompt_ids)
        try:
            yield from self.engine.continue_from(logits, max_new_tokens, temperature, top_p, seed, stop_event,
                                                 eos_ids)
        finally:
            self._remember()

    def _resume(self, ids: list[int]) -> int:
        """Cut the state back to what `ids` starts with; how many tokens it keeps (at least
        one token of `ids` is left to feed, for its logits)."""
        engine = self.engine
        held = engine.sequence_ids()
        common = min(common_prefix(held, ids), len(ids) - 1)
        if common == len(held):
            return common
        if common > 0 and engine.rewinds_anywhere():
            engine.rewind(common)
            return common
        usable = [s for s in self.snapshots if s.pos <= common and engine.can_restore(s)]
        if not usable:
            return 0
        best = max(usable, key=lambda s: s.pos)
        engine.restore_state(best)
        self.snapshots = [s for s in self.snapshots if s.pos <= best.pos]
        return best.pos

    def _remember(self) -> None:
        engine = self.engine
        if engine.rewinds_anywhere():
            return
        if self.snapshots and self.snapshots[-1].pos == len(engine.sequence_ids()):
            return
        self.snapshots = (self.snapshots + [engine.save_state()])[-self.keep:]
