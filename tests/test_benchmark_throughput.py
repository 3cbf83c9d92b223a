"""benchmark/throughput.py: the steady-state rate skips warm-up, variants parse, the ceiling runs, time shares,
weak scaling and shares of the ceiling are computed as documented, a tiny real run writes the table and the
plot; benchmark/profile_rollout.py splits a rank's iteration into parts that add up to its wall time, and
`--profile` puts that split next to the same invocation's SPS and ceiling."""

import argparse
import os

import numpy as np
import pytest
import torch
from helpers import REPO

from benchmark.profile_rollout import PARTS, is_profilable, profile_iterations
from benchmark.throughput import (
    CEILING,
    best_settings,
    ceiling_shares,
    cudagraphs_flag,
    env_settings,
    main,
    parse_variant,
    rank_cores,
    run_once,
    steady_sps,
    time_shares,
    weak_scaling,
)


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


def test_time_shares_read_the_perf_scalars_after_warmup():
    def tag(*values):
        return [(float(i), i, v) for i, v in enumerate(values)]

    events = {
        "perf/rollout_seconds": tag(9.0, 1.0, 1.0),
        "perf/update_seconds": tag(9.0, 3.0, 3.0),
        "perf/grad_sync_seconds": tag(9.0, 1.5, 0.0),
    }
    assert time_shares(events, warmup=1) == pytest.approx((0.75, 0.25))
    update_share, sync_share = time_shares({k: v for k, v in events.items() if "grad_sync" not in k}, warmup=1)
    assert update_share == pytest.approx(0.75) and np.isnan(sync_share)  # ddp: the all-reduce is not timed apart
    # no rollout timing (DQN): the update's share of the wall time between the logged points after warm-up
    dqn = {"perf/update_seconds": [(100.0, 400, 9.0), (110.0, 800, 4.0), (130.0, 1200, 6.0)]}
    assert time_shares(dqn, warmup=1)[0] == pytest.approx(10.0 / 30.0)


def test_weak_scaling_compares_each_variant_with_its_own_single_rank_rate():
    rows = [dict(world_size=1, name="ddp", sps=100.0), dict(world_size=2, name="ddp", sps=150.0)]
    rows += [dict(world_size=2, name="flat", sps=150.0)]
    weak_scaling(rows)
    assert [r["efficiency"] for r in rows[:2]] == [1.0, 0.75] and np.isnan(rows[2]["efficiency"])


def test_cores_per_rank_pins_until_the_machine_runs_out():
    available = sorted(os.sched_getaffinity(0))
    assert rank_cores(1, 0) is None
    assert rank_cores(1, 1) == available[:1]
    assert rank_cores(len(available) + 1, 1) == available  # oversubscribed: every core


def test_a_tiny_real_run_writes_the_table_and_the_plot(tmp_path):
    out = tmp_path / "out"
    argv = ["--script", "cleanrl_ddp/ppo_multigpu.py", "--env-id", "CartPole-v1", "--world-sizes", "2"]
    argv += ["--variant", "flat=--grad-sync flat", "--repeats", "1", "--iterations", "4", "--warmup", "1"]
    argv += ["--local-num-envs", "2", "--num-steps", "32", "--ceiling-steps", "20", "--out", str(out)]
    assert main(argv) == 0
    table = (out / "throughput.md").read_text()
    flat_row = next(line for line in table.splitlines() if line.startswith("| 2 | ") and "| flat |" in line)
    sync_share = flat_row.split("|")[7].strip()
    assert sync_share.endswith("%") and 0 <= int(sync_share[:-1]) <= 100, flat_row
    assert "Regenerate: `python -m benchmark.throughput --script cleanrl_ddp/ppo_multigpu.py" in table
    assert f"\n# packages: torch {torch.__version__} (CUDA " in table and ", gymnasium 1." in table  # what ran
    assert "Each run's command: [runs.txt](runs.txt)." in table
    runs = (out / "runs.txt").read_text()
    assert "# ws=2 flat: torchrun --standalone --nproc_per_node=2 cleanrl_ddp/ppo_multigpu.py --grad-sync flat" in runs
    assert (out / "sps_vs_world_size.png").stat().st_size > 1000


PEER = """
import argparse, time
from torch.utils.tensorboard import SummaryWriter
p = argparse.ArgumentParser()  # CleanRL's flags, no more: ours (--runs-dir, --checkpoint-every, ...) would fail it
for flag in ("--env-id", "--seed", "--NUM-ENVS", "--num-steps", "--total-timesteps", "--learning-starts"):
    p.add_argument(flag)
args = p.parse_args()
writer = SummaryWriter(f"runs/{args.env_id}__peer__{args.seed}")  # where it starts, as CleanRL's scripts write
for i in range(1, 6):
    time.sleep(0.02)
    writer.add_scalar("charts/SPS", 100.0, i * int(args.NUM_ENVS) * int(args.num_steps))
writer.close()
"""


def test_another_projects_script_gets_cleanrls_flags_and_its_own_folder(tmp_path):
    """A --compare script outside cleanrl_ddp/ (CleanRL's own) takes only CleanRL's flags and writes runs/ where it
    starts, with --peer-flags; its events are read from there, its command shown as given. One with no
    --local-num-envs (CleanRL's ppo.py) gets --num-envs."""
    sizes = dict(local_num_envs=2, num_steps=16, extra=["--our-flag"])  # flags after `--` are ours only
    tail = "--num-steps 16 --total-timesteps 128 --env-id CartPole-v1 --seed 3 --learning-starts 7"
    for name, envs in (("peer_multigpu.py", "local_num_envs"), ("peer_ppo.py", "num_envs")):
        (tmp_path / name).write_text(PEER.replace("NUM-ENVS", envs.replace("_", "-")).replace("NUM_ENVS", envs))
        peer = os.path.relpath(tmp_path / name)  # as a reader names it; it runs elsewhere
        out = run_once(peer, "CartPole-v1", 1, 3, [], sizes, 4, 60, peer_flags=["--learning-starts", "7"])
        assert out["command"] == f"python {peer} --{envs.replace('_', '-')} 2 {tail}"
        assert [step for _, step, _ in out["events"]["charts/SPS"]] == [32, 64, 96, 128, 160]


def test_each_row_is_a_share_of_its_own_world_sizes_ceiling():
    rows = [dict(world_size=1, name="default", sps=100.0), dict(world_size=1, name=CEILING, sps=400.0)]
    rows += [dict(world_size=2, name="default", sps=150.0), dict(world_size=2, name=CEILING, sps=1000.0)]
    rows += [dict(world_size=3, name="default", sps=150.0)]  # no ceiling measured (--ceiling-steps 0)
    ceiling_shares(rows)
    assert [r["ceiling_share"] for r in rows[:4]] == [0.25, 1.0, 0.15, 1.0] and np.isnan(rows[4]["ceiling_share"])


@pytest.fixture
def one_thread():
    """One torch thread, as a rank on one core has (two OpenMP threads crawl on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("script, cudagraphs", [("ppo_atari_multigpu", None), ("ppo_atari_async_multigpu", True)])
def test_profile_parts_add_up_to_the_iterations_wall_time(script, cudagraphs, one_thread):
    # one warm-up iteration left out, one timed: 2 envs (two halves of 1 in the async variant) x 8 steps; the
    # script's default path, or --cudagraphs (on the CPU the same functions run eagerly: nothing is captured)
    result = profile_iterations(
        f"cleanrl_ddp.{script}", "breakout", 2, 8, iterations=1, warmup=1, cudagraphs=cudagraphs
    )
    assert result["captured"] is False and result["num_steps"] == 8
    seconds, total = result["seconds"], result["total"]
    assert set(seconds) == set(PARTS)
    assert all(seconds[part] > 0 for part in ("env", "policy", "copies", "bookkeeping", "update")), seconds
    timed = sum(seconds[part] for part in PARTS if part != "other")
    assert timed <= total and seconds["other"] == pytest.approx(total - timed)  # nothing counted twice
    assert result["sps"] == pytest.approx(2 * 8 / total)


def test_the_profile_follows_the_runs_cudagraphs_flag():
    """`-- --cudagraphs` or `-- --no-cudagraphs` (the last one given) reach the profile; neither: the default."""
    assert cudagraphs_flag(["--seed", "2"]) is None
    assert cudagraphs_flag(["--cudagraphs"]) is True and cudagraphs_flag(["--no-cudagraphs"]) is False
    assert cudagraphs_flag(["--cudagraphs", "--no-cudagraphs"]) is False


def test_only_scripts_with_the_rollout_pieces_are_profiled():
    assert is_profilable("cleanrl_ddp/ppo_atari_multigpu.py") and is_profilable(
        "cleanrl_ddp/ppo_atari_async_multigpu.py"
    )
    assert not is_profilable("cleanrl_ddp/ppo_multigpu.py")
    assert not is_profilable("benchmark/peers/cleanrl_ppo_atari_multigpu.py")  # read, not imported


def test_profile_mode_puts_the_split_next_to_the_runs_sps_and_ceiling(capsys):
    argv = ["--script", "cleanrl_ddp/ppo_atari_multigpu.py", "--env-id", "breakout", "--world-sizes", "1"]
    argv += ["--local-num-envs", "2", "--num-steps", "16", "--iterations", "3", "--warmup", "1", "--repeats", "1"]
    argv += ["--ceiling-steps", "20", "--profile", "--profile-iterations", "1", "--cores-per-rank", "1"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    run_row = next(line for line in lines if line.startswith("| 1 | ") and "| default |" in line).split("|")
    ceiling_row = next(line for line in lines if line.startswith("| 1 | ") and f"| {CEILING} |" in line).split("|")
    profile_row = next(line for line in lines if line.startswith("| 1 | ppo_atari_multigpu.py | 2 |")).split("|")
    sps, ceiling = float(run_row[4]), float(ceiling_row[4])
    # the share comes from the unrounded rates: any rate within half a step/s of the printed ones may have made it
    lowest, highest = (sps - 0.5) / (ceiling + 0.5), (sps + 0.5) / (ceiling - 0.5)
    share = int(run_row[8].strip().rstrip("%"))
    assert round(100 * lowest) <= share <= round(100 * highest), (run_row, ceiling_row)  # as "{:.0f}" rounds
    assert float(profile_row[5].replace(",", "")) == round(sps) and float(profile_row[6].replace(",", "")) == round(
        ceiling
    )
    shares = [int(cell.split("(")[1].rstrip("%) ")) for cell in profile_row[9:15]]  # env ... other
    assert 97 <= sum(shares) <= 103, profile_row  # rounded shares of one total


def test_the_profile_does_not_import_the_throughput_tool():
    """benchmark/throughput.py uses benchmark/profile_rollout.py (for --profile), never the other way round: what
    both use (rank_threads) lives in benchmark/harness.py. Read from the sources, every import (nested ones too)."""
    import ast
    from pathlib import Path

    def imported(path):
        names = set()
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        return names

    assert "benchmark.profile_rollout" in imported("benchmark/throughput.py")
    assert not {"benchmark.throughput", "benchmark.throughput.rank_threads"} & imported("benchmark/profile_rollout.py")
    assert "benchmark.harness.rank_threads" in imported("benchmark/profile_rollout.py")


def test_env_sweep_settings_and_the_best_line():
    """--env-sweep's settings: powers of two up to the scripts' own min(envs, cores) threads, the whole batch then
    half; its lines name the fastest setting and the fastest whole-batch one against the scripts' threads."""
    assert env_settings(8, 16) == [(1, 8), (2, 8), (4, 8), (8, 8), (1, 4), (2, 4), (4, 4), (8, 4)]
    assert [t for t, b in env_settings(64, 12) if b == 64] == [1, 2, 4, 8, 12]
    rows = [dict(num_envs=8, num_threads=t, batch_size=b, sps=1000.0 * t / (b // 4)) for t, b in env_settings(8, 4)]
    assert best_settings(rows, 4) == [
        "env-sweep 8 envs best: num_threads 4, batch_size 4: 4,000 steps/s; all 8 at once: num_threads 4, "
        "2,000 steps/s = 1.00x the scripts' num_threads 4 (2,000)"
    ]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--script", "nope.py"], "--script nope.py: no such file"),
        (["--world-sizes", "0"], "--world-sizes and --repeats must be at least 1"),
        (["--iterations", "4", "--warmup", "4"], "--iterations 4 leaves no steady rate after --warmup 4"),
        (["--compare", "nope.py"], "--compare nope.py: no such file"),
        (
            ["--script", "benchmark/peers/cleanrl_ppo.py"],
            "--script benchmark/peers/cleanrl_ppo.py: not a script of cleanrl_ddp/ (another project's: --compare)",
        ),
        (
            ["--compare", "benchmark/peers/cleanrl_ppo.py"],
            "--compare benchmark/peers/cleanrl_ppo.py takes no --local-num-envs (one process): use --world-sizes 1",
        ),
        (
            ["--compare", "cleanrl_ddp/ppo_multigpu.py", "--peer-flags=--learning-starts 4"],
            "--peer-flags: no --compare script of another project to take them (ours take flags after --)",
        ),
    ],
    ids=[
        "no-script",
        "world-size-0",
        "all-warmup",
        "no-compare",
        "peer-as-script",
        "one-process-peer-at-2-ranks",
        "peer-flags-without-a-peer",
    ],
)
def test_bad_flags_are_one_line(monkeypatch, capsys, flags, message):
    monkeypatch.chdir(REPO)  # the default --script, relative to the repository
    with pytest.raises(SystemExit) as leave:
        main(flags)
    assert leave.value.code == 2 and f"error: {message}" in capsys.readouterr().err


def test_a_failed_run_ends_in_one_error_and_its_output_not_a_traceback(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    argv = ["--script", "cleanrl_ddp/ppo_multigpu.py", "--env-id", "CartPole-v1", "--world-sizes", "1"]
    argv += ["--iterations", "2", "--warmup", "1", "--repeats", "1", "--", "--num-minibatches", "0"]
    with pytest.raises(SystemExit) as leave:
        main(argv)
    message = str(leave.value.code)
    assert message.startswith("throughput: error: ") and " exited 2:" in message, message
    assert "--num-minibatches must be at least 1, got 0" in message  # the run's own line, its cause
