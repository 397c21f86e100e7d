"""Clean A/B arms: every arm starts from the same residency and heat state.

One arm's cache and usage state leaking into the next is the classic A/B
trap: the second arm finds the first arm's experts in RAM and looks better.
`ArmState.capture` takes the state once (the RAM slots' experts in LRU order
with their pins, the GPU tier's residents, the heat counts HOT pins from,
with the model's fingerprint) and `restore` puts it back before each arm,
after a cold start (fresh router, prefetch state, sequence and meters). So an
arm's meters do not depend on which arms ran before it.

Capturing also freezes the engine's HEAT_FILE: the arms' routings are never
merged into the heat profile, which stays as the engine read it.

`ab`, `replay` and `sweep` call these; `to_json`/`from_json` carry a state
to another process (a sweep worker), which refuses it for another model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierlab.engine.errors import TierlabError
from tierlab.engine.expert_store import ResidencyState
from tierlab.engine.fingerprint import short
from tierlab.engine.surface import EngineSurface


@dataclass(frozen=True)
class ArmState:
    fingerprint: str
    residency: ResidencyState
    heat: np.ndarray  # int64[L, E]: the engine's heat counts (HOT pins the hottest)

    @classmethod
    def capture(cls, engine: EngineSurface) -> "ArmState":
        """The engine's state now; from now on its HEAT_FILE is frozen."""
        engine.freeze_heat_file()
        return cls(engine.fingerprint, engine.residency_state(), np.array(engine.heat, dtype=np.int64, copy=True))

    def restore(self, engine: EngineSurface) -> None:
        """Cold-start the engine, then put the captured residency and heat back."""
        if engine.fingerprint != self.fingerprint:
            raise TierlabError(f"arm state of model {short(self.fingerprint)} cannot be restored on "
                               f"model {short(engine.fingerprint)}")
        engine.cold_start()
        engine.restore_residency(self.residency)
        engine.heat[:] = self.heat

    def to_json(self) -> dict:
        r = self.residency
        return {"fingerprint": self.fingerprint, "slots": r.slots,
                "ram": [None if held is None else [[e, int(p)] for e, p in held] for held in r.ram],
                "tier": [list(t) for t in r.tier], "heat": self.heat.tolist()}

    @classmethod
    def from_json(cls, data: dict) -> "ArmState":
        try:
            ram = tuple(None if held is None else tuple((int(e), bool(p)) for e, p in held) for held in data["ram"])
            residency = ResidencyState(int(data["slots"]), ram, tuple((int(l), int(e)) for l, e in data["tier"]))
            return cls(str(data["fingerprint"]), residency, np.asarray(data["heat"], dtype=np.int64))
        except (KeyError, TypeError, ValueError) as exc:
            raise TierlabError(f"malformed arm state ({type(exc).__name__}: {exc})") from None
