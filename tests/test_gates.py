"""Quality gates: the verdict of each gate, its edges, and the flags that set them."""

import argparse

import pytest

from tierlab.app.cli.gate_args import add_gate_args, gates_from_args
from tierlab.app.lab.gates import Gates, judge
from tierlab.engine.errors import TierlabError

GOOD = {"dnll_hi": 0.01, "agree": 0.99, "kl_p99": 0.1, "flips": 0.0}


def test_a_row_within_every_gate_passes():
    verdict = judge(GOOD, Gates())
    assert verdict.passed and verdict.failed == () and verdict.label() == "pass"


@pytest.mark.parametrize("key,value", [("dnll_hi", 0.03), ("agree", 0.9), ("kl_p99", 0.6), ("flips", 0.02)])
def test_each_gate_fails_alone_and_is_named(key, value):
    verdict = judge({**GOOD, key: value}, Gates())
    assert not verdict.passed
    assert verdict.failed == (key,)
    assert verdict.label() == f"FAIL {key}"


def test_the_limits_themselves_pass():
    gates = Gates()
    edge = {"dnll_hi": gates.dnll, "agree": gates.agree, "kl_p99": gates.kl99, "flips": gates.flips}
    assert judge(edge, gates).passed


def test_unmeasured_figures_are_listed_not_failed():
    verdict = judge({"agree": 0.5}, Gates())
    assert verdict.failed == ("agree",)
    assert set(verdict.unmeasured) == {"dnll_hi", "kl_p99", "flips"}
    assert judge({}, Gates()).label() == "–"


def test_flags_set_the_gates_and_refuse_bad_values():
    parser = argparse.ArgumentParser()
    add_gate_args(parser)
    gates = gates_from_args(parser.parse_args(["--gate-dnll", "0.1", "--gate-agree", "0.8"]))
    assert gates == Gates(dnll=0.1, agree=0.8)
    assert judge({**GOOD, "agree": 0.85, "dnll_hi": 0.05}, gates).passed
    with pytest.raises(TierlabError, match="--gate-agree"):
        gates_from_args(parser.parse_args(["--gate-agree", "1.5"]))
    with pytest.raises(TierlabError, match="--gate-kl99"):
        gates_from_args(parser.parse_args(["--gate-kl99", "nan"]))
