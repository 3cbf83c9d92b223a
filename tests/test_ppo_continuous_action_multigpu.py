"""ppo_continuous_action_multigpu.py: normalisation statistics that agree across ranks, runs at world sizes
1 and 2 on MuJoCo, resume of the statistics, bad input, and learning InvertedPendulum."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import launch, main_error, main_output, only_run_dir, read_scalars

from cleanrl_ddp import evals
from cleanrl_ddp.ppo_continuous_action_multigpu import (
    Args,
    RunningStats,
    eval_action,
    load_agent,
    make_env,
    normalize_obs,
)

pytest.importorskip("mujoco", reason='needs the mujoco extra: pip install -e ".[test,mujoco]"')

SCRIPT = "ppo_continuous_action_multigpu.py"
TINY = ["--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "2"]
WORKER = Path(__file__).with_name("continuous_stats_worker.py")


def test_running_stats_match_numpy_in_one_process():
    rng = np.random.default_rng(0)
    stats = RunningStats((2,))
    assert torch.equal(stats.var, torch.ones(2))  # before any sample: identity normalisation
    chunks = [rng.normal([100.0, -3.0], [0.01, 4.0], size=(n, 2)) for n in (1, 7, 300, 2)]
    for chunk in chunks:
        stats.update(torch.as_tensor(chunk))
    ref = np.concatenate(chunks)
    assert stats.count.item() == len(ref)
    np.testing.assert_allclose(stats.mean.numpy(), ref.mean(0), rtol=1e-12)
    np.testing.assert_allclose(stats.var.numpy(), ref.var(0), rtol=1e-9)  # feature 0: mean/std = 1e4
    normalized = normalize_obs(ref, stats, clip=10.0)
    assert normalized.dtype == torch.float32
    np.testing.assert_allclose(normalized.mean(0), 0.0, atol=1e-4)


def test_running_stats_ignore_an_empty_batch():
    """No samples leave the statistics as they are, before and after the first ones (no `if` on a device value)."""
    stats = RunningStats((2,))
    stats.update(torch.zeros((0, 2), dtype=torch.float64))
    assert stats.count.item() == 0 and torch.equal(stats.var, torch.ones(2)) and torch.equal(stats.mean, torch.zeros(2))
    stats.update(torch.tensor([[1.0, 2.0], [3.0, 6.0]], dtype=torch.float64))
    before = [t.clone() for t in stats.tensors()]
    stats.update(torch.zeros((0, 2), dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip(before, stats.tensors(), strict=True))


def test_global_statistics_equal_one_process_over_all_ranks(tmp_path):
    out = tmp_path / "stats.json"
    proc = launch(WORKER, [out], nproc=2, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["identical"]  # bit-identical on both ranks after every iteration
    assert result["max_rel_error"] < 1e-12, result
    assert result["counts"] == [117, 244, 381, 528]  # (50 + 67) + (55 + 72) + ...: both ranks' samples


def check_run(run_dir: Path, world: int, iterations: int, env="HalfCheetah-v5", obs_dim=17, batch=64, updates=4):
    """Asserts on what a run wrote (TINY: HalfCheetah-v5, 64 steps per rank and iteration, 4 updates); returns its
    checkpoint."""
    assert env in run_dir.name
    scalars = read_scalars(run_dir)
    steps = [s for s, _ in scalars["losses/value_loss"]]
    assert steps == [i * world * batch for i in range(1, iterations + 1)]  # global steps, one per update
    assert all(v == updates for _, v in scalars["charts/updates_per_iteration"])
    assert [v for _, v in scalars["norm/count"]] == steps  # the statistics count every rank's samples
    assert all(np.isfinite(v) for _, v in scalars["norm/return_std"])
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert ckpt["obs_stats"]["count"].item() == ckpt["return_stats"]["count"].item() == steps[-1]
    assert ckpt["obs_stats"]["mean"].shape == (obs_dim,)
    return ckpt


# 20 iterations of 2 ranks x 4 envs x 256 steps: seeds 1 and 2 reached 1000 within 37k steps; the default seed's mean
# over 5 iterations' episodes passes 500 at 32,768 and its policy balances for 1000 steps from 30k
INVERTED_PENDULUM_STEPS = 40_960


@pytest.fixture(scope="module")
def inverted_pendulum_run(tmp_path_factory) -> Path:
    """The 2-rank run that learns InvertedPendulum-v5 (4 envs x 256 steps per rank, 8 minibatches, 10 epochs), its
    replicas compared after every iteration (--sync-check-every 1: the job exits 3 if parameters, optimizer state or
    statistics differ across ranks); its run directory."""
    runs = tmp_path_factory.mktemp("inverted-pendulum")
    args = [
        "--env-id", "InvertedPendulum-v5",
        "--total-timesteps", INVERTED_PENDULUM_STEPS,
        "--local-num-envs", 4,
        "--num-steps", 256,
        "--num-minibatches", 8,
        "--learning-rate", 1e-3,
        "--runs-dir", runs,
        "--checkpoint-every", 0,
        "--sync-check-every", 1,
    ]  # fmt: skip
    proc = launch(SCRIPT, args, nproc=2, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return only_run_dir(runs)


def test_two_ranks_run_with_identical_statistics(inverted_pendulum_run):
    """The learning run below: no replica check failed, and the statistics count every rank's samples."""
    iterations, env = INVERTED_PENDULUM_STEPS // 2048, "InvertedPendulum-v5"
    check_run(inverted_pendulum_run, world=2, iterations=iterations, env=env, obs_dim=4, batch=4 * 256, updates=8 * 10)


def test_one_rank_runs_and_resume_restores_the_statistics(tmp_path, monkeypatch, capsys):
    """One rank, here (helpers.main_output): 2 iterations, then --resume to 4."""
    common = [*TINY, "--runs-dir", tmp_path]
    main_output(monkeypatch, capsys, SCRIPT, *common, "--total-timesteps", 128)
    run_dir = only_run_dir(tmp_path)
    first = check_run(run_dir, world=1, iterations=2)
    resumed = main_output(monkeypatch, capsys, SCRIPT, *common, "--total-timesteps", 256, "--resume", run_dir)
    assert "resuming at iteration 3" in resumed
    second = check_run(run_dir, world=1, iterations=4)  # 128 restored + 128 new, not 128 from scratch
    assert not torch.equal(first["obs_stats"]["m2"], second["obs_stats"]["m2"])


def test_discrete_env_is_one_clear_line(tmp_path, monkeypatch):
    message = main_error(monkeypatch, SCRIPT, "--env-id", "CartPole-v1", "--runs-dir", tmp_path)  # in this process
    assert "Discrete action space" in message
    assert not any(tmp_path.iterdir())


def evaluate_checkpoint(checkpoint: Path, episodes: int) -> np.ndarray:
    """Returns of the mean action, with the observations normalised by the checkpoint's statistics."""
    ckpt = torch.load(checkpoint, weights_only=True)
    args, device = Args(**ckpt["args"]), torch.device("cpu")
    eval_envs = evals.make_envs(make_env, args, episodes)
    returns, _, _ = evals.play(load_agent(ckpt, device), eval_action, eval_envs, args, True, 10_000, device)
    eval_envs.close()
    return returns


def test_learns_inverted_pendulum_with_two_ranks(inverted_pendulum_run):
    returns = [v for _, v in read_scalars(inverted_pendulum_run)["charts/episodic_return"]]
    recent = np.convolve(returns, np.ones(5) / 5, mode="valid")  # mean over 5 iterations' episodes
    assert recent.max() > 500, f"best recent mean return {recent.max():.1f} (max 1000)"
    # the trained policy, evaluated with the run's global statistics, balances too
    assert np.mean(evaluate_checkpoint(inverted_pendulum_run / "checkpoint.pt", episodes=2)) > 500
