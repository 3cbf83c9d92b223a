"""ppo_multigpu.py: sizes, GAE and loss against hand-computed values, runs at world sizes 1 and 2,
bad input, and learning CartPole."""

import dataclasses
import re

import numpy as np
import pytest
import torch
from helpers import launch, main_error, main_output, only_run_dir, read_scalars

from cleanrl_ddp.ppo_multigpu import Args, compute_gae, derive_sizes, normalize_advantages, ppo_loss

SCRIPT = "ppo_multigpu.py"
TINY = ["--local-num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "2"]


def test_derived_sizes_follow_world_size():
    args = Args(local_num_envs=4, num_steps=128, num_minibatches=4, total_timesteps=10_000)
    assert dataclasses.asdict(derive_sizes(args, 2)) == dict(
        world_size=2,
        num_envs=8,
        local_batch_size=512,
        batch_size=1024,
        local_minibatch_size=128,
        minibatch_size=256,
        num_iterations=9,
    )
    assert derive_sizes(args, 3).batch_size == 1536
    assert derive_sizes(args, 3).num_iterations == 6


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_minibatches=3), "does not divide"),
        (dict(local_num_envs=0), "--local-num-envs must be at least 1"),
        (dict(total_timesteps=1000), "smaller than one iteration"),
    ],
)
def test_derived_sizes_reject_bad_input(change, message):
    with pytest.raises(ValueError, match=message):
        derive_sizes(dataclasses.replace(Args(), **change), 2)


def test_derived_sizes_are_not_flags():
    fields = {f.name for f in dataclasses.fields(Args)}
    derived = {"num_envs", "batch_size", "local_batch_size", "minibatch_size", "local_minibatch_size"}
    assert not fields & (derived | {"num_iterations", "world_size"})


def test_gae_matches_hand_computation():
    # one env, three steps; obs[2] starts a new episode (dones[2] = 1)
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[0.5], [1.0], [1.5]])
    dones = torch.tensor([[0.0], [0.0], [1.0]])
    next_value, next_done = torch.tensor([[2.0]]), torch.tensor([0.0])
    adv, ret = compute_gae(rewards, values, dones, next_value, next_done, gamma, lam)
    d2 = 3.0 + 0.9 * 2.0 - 1.5  # bootstraps from next_value
    d1 = 2.0 + 0.0 - 1.0  # obs[2] is a new episode: no bootstrap through it
    d0 = 1.0 + 0.9 * 1.0 - 0.5
    a2, a1 = d2, d1
    a0 = d0 + gamma * lam * a1
    assert torch.allclose(adv.flatten(), torch.tensor([a0, a1, a2]))
    assert torch.allclose(ret, adv + values)


def test_normalize_advantages_normalises_each_minibatch_row():
    """An epoch's minibatches as rows [num_minibatches, minibatch]: each row with its own mean and unbiased std."""
    adv = torch.tensor([[1.0, 2.0, 3.0, 6.0], [-4.0, 0.0, 4.0, 100.0]])
    expected = torch.stack([(row - row.mean()) / (row.std() + 1e-8) for row in adv])
    assert torch.allclose(normalize_advantages(adv, 1), expected)
    assert torch.allclose(normalize_advantages(adv[1], 1), expected[1])  # one minibatch alone


def test_ppo_loss_matches_hand_computation():
    args = Args(clip_coef=0.2, ent_coef=0.01, vf_coef=0.5, norm_adv=True, clip_vloss=True)
    new_logprob = torch.log(torch.tensor([0.5, 0.3]))
    old_logprob = torch.log(torch.tensor([0.25, 0.3]))  # ratios 2.0 and 1.0
    entropy = torch.tensor([0.6, 0.4])
    new_value = torch.tensor([[1.0], [3.0]])
    model = lambda obs, actions: (actions, new_logprob, entropy, new_value)  # stands in for the agent
    adv = torch.tensor([1.0, -1.0])
    returns, old_values = torch.tensor([2.0, 2.0]), torch.tensor([1.5, 2.9])
    norm = adv / (adv.std() + 1e-8)  # [0.7071, -0.7071]
    assert torch.allclose(normalize_advantages(adv, 1), norm)
    loss, stats = ppo_loss(model, norm, None, torch.tensor([0, 1]), old_logprob, returns, old_values, args)

    # sample 0: ratio 2 clipped to 1.2 (max of -0.707*2, -0.707*1.2); sample 1: ratio 1
    pg = (max(-norm[0] * 2.0, -norm[0] * 1.2) + max(-norm[1] * 1.0, -norm[1] * 1.0)) / 2
    # value 0: unclipped (1-2)^2=1, clipped 1.5-0.2=1.3 -> 0.49, max 1; value 1: (3-2)^2=1, clipped 3.0 -> 1
    v = 0.5 * (1.0 + 1.0) / 2
    expected = pg - 0.01 * 0.5 + 0.5 * v
    assert loss.item() == pytest.approx(float(expected), rel=1e-5)
    assert stats["policy_loss"].item() == pytest.approx(float(pg), rel=1e-5)
    assert stats["value_loss"].item() == pytest.approx(v, rel=1e-5)
    assert stats["clipfrac"].item() == pytest.approx(0.5)  # clipfrac: one of two ratios outside [0.8, 1.2]


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory):
    """The 2-rank run that learns CartPole (test_learns_cartpole_with_two_ranks): (its output, its run directory)."""
    runs = tmp_path_factory.mktemp("cartpole")
    flags = ["--total-timesteps", 160_000, "--learning-rate", 1e-3, "--checkpoint-every", 0]
    flags += ["--eval-every", 8192, "--eval-episodes", 10, "--target-return", 450]
    proc = launch(SCRIPT, [*flags, "--runs-dir", runs], nproc=2, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, only_run_dir(runs)


@pytest.mark.parametrize("nproc", [1, 2], ids=["one-rank", "torchrun-2"])
def test_training_runs_and_logs(tmp_path, monkeypatch, capsys, nproc, request):
    """One rank, 3 iterations of TINY, in this process (helpers.main_output); 2 ranks: the CartPole learning run (4
    envs x 128 steps per rank, 4 epochs of 4 minibatches)."""
    if nproc == 1:
        batch, updates = 2 * 32, 2 * 2
        main_output(monkeypatch, capsys, SCRIPT, *TINY, "--total-timesteps", 3 * batch, "--runs-dir", tmp_path)
        run_dir = only_run_dir(tmp_path)
    else:
        (_, run_dir), batch, updates = request.getfixturevalue("cartpole_run"), 2 * 4 * 128, 4 * 4
    iterations = torch.load(run_dir / "checkpoint.pt", weights_only=True)["iteration"]
    assert iterations >= 3
    scalars = read_scalars(run_dir)
    steps = [s for s, _ in scalars["losses/value_loss"]]
    assert steps == [i * batch for i in range(1, iterations + 1)]  # global steps, one per update
    assert all(v == updates for _, v in scalars["charts/updates_per_iteration"])
    for tag in ("losses/policy_loss", "losses/entropy", "losses/approx_kl", "charts/SPS", "charts/episodic_return"):
        assert tag in scalars, sorted(scalars)
    assert all(np.isfinite(v) for _, v in scalars["charts/episodic_return"])


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--num-minibatches", "5"], "does not divide into --num-minibatches 5"),
        (["--local-num-envs", "0"], "--local-num-envs must be at least 1"),
        (["--total-timesteps", "100"], "smaller than one iteration"),
        (["--env-id", "NoSuchEnv-v9"], "unknown --env-id 'NoSuchEnv-v9'.*CartPole-v1"),
        (["--env-id", "Pendulum-v1"], "Box action space"),
    ],
    ids=["indivisible", "zero-envs", "tiny-budget", "unknown-env", "continuous-env"],
)
def test_bad_input_is_one_clear_line(tmp_path, monkeypatch, args, pattern):
    """In this process (helpers.main_error); a bad flag as a 2-rank command, every rank failing and rank 0 alone
    saying it: tests/test_bad_inputs.py."""
    assert re.search(pattern, main_error(monkeypatch, SCRIPT, *args, "--runs-dir", tmp_path))
    assert not any(tmp_path.iterdir())  # nothing written


def test_learns_cartpole_with_two_ranks(cartpole_run):
    """2 ranks: rank 0's greedy policy, evaluated on 10 episodes every 8,192 steps, reaches a mean return of 450 (of
    500; a random policy scores about 22) within 160k steps, and --target-return stops the run there (about 25k:
    7 s instead of 25 s for the whole budget)."""
    proc, run_dir = cartpole_run
    scalars = read_scalars(run_dir)
    *_, (step, evaluated) = scalars["eval/episodic_return"]
    assert evaluated >= 450 and f"reached --target-return 450.0 at global step {step};" in proc.stdout, proc.stdout
    assert step < 160_000  # stopped early: it learned, not merely ran out of budget
    # the stop itself (tests/test_evaluation.py, for the Atari scripts): every rank stopped at the evaluation's
    # iteration, after a final checkpoint
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["global_step"] == step
    assert max(s for s, _ in scalars["charts/SPS"]) == step  # no rank went on training


def test_resume_takes_sizes_from_the_checkpoint(tmp_path, monkeypatch, capsys):
    # A tiny run, then extended with only --total-timesteps: the size flags come from the checkpoint
    # (the defaults, 4 envs x 128 steps, would not even fit one iteration into this budget). Both in this process
    # (helpers.main_output), as the plain-python command runs them.
    main_output(monkeypatch, capsys, SCRIPT, *TINY, "--total-timesteps", 128, "--runs-dir", tmp_path)
    run_dir = only_run_dir(tmp_path)
    again = main_output(monkeypatch, capsys, SCRIPT, "--resume", run_dir, "--total-timesteps", 256)
    assert "resuming at iteration 3, global step 128" in again
    # by step: TensorBoard reads a run's files in name order, and two writers of one process within one second
    # differ only in a counter it compares as text ("10" before "9")
    steps = sorted(s for s, _ in read_scalars(run_dir)["losses/value_loss"])
    assert steps == [64, 128, 192, 256]
    files = sorted(p.name for p in run_dir.iterdir())
    done = main_error(monkeypatch, SCRIPT, "--resume", run_dir)  # a finished run: refused before any log is opened
    assert "has finished: its checkpoint is at global step 256, and --total-timesteps 256" in done
    assert sorted(p.name for p in run_dir.iterdir()) == files
