"""A decoded token's shared expert in one compiled call (`shared_expert_step`) gives the bits
of `MoEBlock._shared_expert`'s calls one by one, for every kind of down projection."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tierlab.engine.moe import MoEBlock
from tierlab.engine.qlinear import pass_operands
from weight_kinds import KINDS, random_weights

HIDDEN, EXPERTS, SHARED = 256, 16, 128


@pytest.mark.parametrize("kind", KINDS)
def test_one_call_gives_the_calls_bits(kind):
    rng = np.random.default_rng(KINDS.index(kind))
    block = MoEBlock.__new__(MoEBlock)  # the shared expert's parts only, no checkpoint
    block.shared_down = random_weights(kind, HIDDEN, SHARED, rng)
    block._shared_step_weights = pass_operands(block.shared_down)
    general = copy.copy(block)
    general._shared_step_weights = None  # the calls one by one
    for token in range(4):
        fused = (rng.standard_normal((1, EXPERTS + 2 * SHARED + 1)) * 2.0).astype(np.float32)
        timers = {"shared": 0.0}
        got = block._shared_expert(fused, EXPERTS, SHARED, timers)
        expected = general._shared_expert(fused, EXPERTS, SHARED, {"shared": 0.0})
        assert got.shape == (1, HIDDEN) and got.tobytes() == expected.tobytes(), token
        assert np.abs(expected).max() > 0 and timers["shared"] > 0
