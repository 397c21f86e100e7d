"""The engine provides every member of the typed surface the app, the lab and the tests use."""

from __future__ import annotations

import inspect

from tierlab.engine.model import load_engine
from tierlab.engine.options import default_model
from tierlab.engine.surface import EngineSurface
from tierlab.engine.tiering import TierOptions


def test_engine_has_every_member_of_the_surface():
    engine = load_engine(default_model(), cache_slots=3, with_tokenizer=True, tier=TierOptions())
    members = set(EngineSurface.__annotations__) | {
        name for name, value in vars(EngineSurface).items() if inspect.isfunction(value) and not name.startswith("_")}
    missing = sorted(name for name in members if not hasattr(engine, name))
    assert not missing
    for name in members - set(EngineSurface.__annotations__):
        assert callable(getattr(engine, name)), name
    stats = engine.store_stats()
    assert stats.slots == engine.cache_slots() == 3 and not stats.tier_on
    assert engine.tier_description() is None
    engine.close()
