"""benchmark/throughput.py: the steady-state rate skips warm-up, variants parse, the ceiling runs."""

import argparse

import pytest

from benchmark.throughput import env_ceiling, parse_variant, steady_sps


def test_steady_rate_leaves_out_warmup():
    # (wall time, global step, logged SPS): a slow first iteration (start-up), then 100 steps/s
    events = [(10.0, 1000, 0), (11.0, 1100, 0), (12.0, 1200, 0), (13.0, 1300, 0)]
    assert steady_sps(events, warmup=1) == pytest.approx(100.0)
    assert steady_sps([(0.0, 0, 0), (50.0, 1000, 0), (60.0, 2000, 0)], warmup=2) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="need more than --warmup 3"):
        steady_sps(events[:3], warmup=3)


def test_variants_are_name_and_flags():
    assert parse_variant("bf16=--precision bf16") == ("bf16", ["--precision", "bf16"])
    assert parse_variant("default=") == ("default", [])
    with pytest.raises(argparse.ArgumentTypeError):
        parse_variant("--precision bf16")


def test_env_ceiling_steps_the_scripts_own_env():
    assert env_ceiling("cleanrl_ddp/ppo_atari_multigpu.py", "breakout", 1, 2, 20) > 0
