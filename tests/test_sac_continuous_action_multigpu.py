"""sac_continuous_action_multigpu.py: sizes, one-line errors, and a 2-rank run that learns Pendulum-v1 on the CPU.

The distributed guarantees (same start, no drift of the critics, actor, targets and log_alpha, the 2-rank update
equal to one process on the union, ddp == flat, schedules) are in tests/test_distributed_correctness.py; SIGTERM,
resume and the world-size change in tests/test_fault_tolerance.py.
"""

import re

import numpy as np
import pytest
import torch
from helpers import main_error, main_output, only_run_dir, read_scalars

from cleanrl_ddp import evaluate, replay
from cleanrl_ddp.runtime import RunError
from cleanrl_ddp.sac_continuous_action_multigpu import Args, derive_sizes

SCRIPT = "sac_continuous_action_multigpu.py"


def test_replay_buffer_is_a_ring_of_the_newest_transitions():
    """SAC's and TD3's buffer: each step's rows after the last, wrapping to the start; float32 columns in order."""
    rb = replay.ReplayBuffer(5, obs_dim=2, action_dim=1, device=torch.device("cpu"), seed=0)
    for step in range(4):  # 2 envs: rows 0-1, 2-3, then 4 and 0, then 1-2
        obs = np.full((2, 2), step, dtype=np.float64) + [[0.0], [0.5]]
        rb.add(obs, obs + 10, obs[:, :1] - 10, obs[:, 0] * 100, np.array([False, True]))
    assert rb.rows[:, 0].tolist() == [2.5, 3.0, 3.5, 1.5, 2.0] and (rb.pos, rb.size) == (3, 5)
    assert rb.rows[0].tolist() == [2.5, 2.5, 12.5, 12.5, -7.5, 250.0, 1.0]
    assert rb.rows[:, -1].tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]
    half = replay.ReplayBuffer(8, obs_dim=2, action_dim=1, device=torch.device("cpu"), seed=0)
    half.add(obs, obs, obs[:, :1], obs[:, 0], np.array([False, False]))
    saved = half.state_dict()["rows"]  # a checkpoint holds the filled rows only, not the ring's storage
    assert saved.shape == (2, 7) and saved.untyped_storage().nbytes() == 2 * 7 * 4
    # another env's rows, another ring's, a position outside it: a run that loads them says so in one line
    for rows, pos in ((saved[:, :6], 2), (torch.zeros(9, 7), 1), (saved, 8)):
        with pytest.raises(ValueError, match=r"do not fit this ring of \(8, 7\)"):
            half.load_state_dict(dict(rows=rows, pos=pos, generator=half.generator.get_state()))


def test_sizes_keep_cleanrls_replay_ratio_by_default():
    """One update per iteration: 256 sampled transitions per env step at any world size; the batch grows."""
    for world_size in (1, 2, 8):
        sizes = derive_sizes(Args(), world_size)
        assert sizes.batch_size == 256 * world_size and sizes.local_buffer_size == 1000000 // world_size
        assert sizes.replay_ratio == 256 and sizes.updates_per_env_step == 1 / world_size
    # CleanRL's exact update at 2 ranks: its global batch and one update per global step
    sizes = derive_sizes(Args(local_batch_size=128, updates_per_iteration=2), 2)
    assert (sizes.batch_size, sizes.replay_ratio, sizes.updates_per_env_step) == (256, 256, 1)
    # a share that does not divide is rounded down (the sizes table shows it): the default on 3 ranks
    assert derive_sizes(Args(), 3).local_buffer_size == 333333
    with pytest.raises(RunError, match="--buffer-size 3 leaves 1 transitions to each of 2 ranks"):
        derive_sizes(Args(buffer_size=3), 2)
    with pytest.raises(RunError, match="--policy-frequency must be at least 1"):
        derive_sizes(Args(policy_frequency=0), 1)


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (["--env-id", "CartPole-v1"], r"CartPole-v1 has a Discrete action space; this script needs a Box one"),
        (["--env-id", "Pendulum-v1", "--updates-per-iteration", "0"], r"--updates-per-iteration must be at least 1"),
    ],
    ids=["discrete-env", "no-updates"],
)
def test_bad_input_is_one_line(tmp_path, monkeypatch, flags, pattern):
    assert re.search(pattern, main_error(monkeypatch, SCRIPT, *flags, "--runs-dir", tmp_path))  # in this process
    assert not any(tmp_path.iterdir())


def test_learns_pendulum(tmp_path, monkeypatch, capsys):
    """One rank x 2 envs in this process (helpers.main_output), the default replay ratio (one update per iteration of 2
    steps) of a global batch of 64 (CleanRL's 256 swings it up at the same step here, at 1.5x the CPU): the global sizes
    of 2 ranks x 1 env, whose updates tests/test_distributed_correctness.py proves equal to this process's on the union
    of their batches (one process costs half the CPU of two on this small network). The deterministic actor, evaluated
    every 500 steps, swings the pendulum up (a random policy scores about -1,200) within 10k steps, and --target-return
    stops the run there (6k on the 2-core machine); the evaluate command plays the checkpoint through the script's
    evaluation interface."""
    flags = ["--env-id", "Pendulum-v1", "--total-timesteps", 10000, "--learning-starts", 1000, "--local-num-envs", 2]
    flags += ["--local-batch-size", 64, "--eval-every", 500, "--eval-episodes", 4, "--target-return", -400]
    out = main_output(monkeypatch, capsys, SCRIPT, *flags, "--runs-dir", tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    *_, (step, evaluated) = scalars["eval/episodic_return"]
    assert evaluated >= -400 and f"reached --target-return -400.0 at global step {step};" in out, scalars
    # the checkpoint, saved at the stop, is data only: it loads without unpickling any object
    ckpt = torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=True)
    assert ckpt["global_step"] == step and ckpt["agent_kwargs"]["action_high"] == [2.0]
    assert ckpt["num_updates"] == (step - 1000) // 2  # one update per iteration of 2 global steps

    capsys.readouterr()  # the evaluate command's main(), in this process (the command: tests/test_evaluation.py)
    assert evaluate.main([str(only_run_dir(tmp_path)), "--episodes", "2"]) == 0
    out = capsys.readouterr().out
    assert f"sac_continuous_action_multigpu Pendulum-v1 at global step {step}: return " in out
    assert "over 2 greedy episodes" in out

    # resumed with another --buffer-size: the saved ring cannot continue in it, so updates wait for a refill
    flags = ["--resume", only_run_dir(tmp_path), "--total-timesteps", step + 40, "--buffer-size", 4000]
    out = main_output(monkeypatch, capsys, SCRIPT, *flags, "--eval-every", 0, "--target-return", "None")
    assert f"updates restart at global step {step + 1000} (buffer refill)" in out
    resumed = torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=True)
    assert resumed["num_updates"] == ckpt["num_updates"] and len(resumed["rank_state"][0]["buffer"]["rows"]) == 40
