"""td3_continuous_action_multigpu.py: sizes, one-line errors, and a 2-rank run that learns Pendulum-v1 on the CPU.

The distributed guarantees (same start, no drift of the critics, the actor and both target networks, the 2-rank
update equal to one process on the union, ddp == flat, schedules) are in tests/test_distributed_correctness.py;
SIGTERM, resume and the world-size change in tests/test_fault_tolerance.py.
"""

import re

import pytest
import torch
from helpers import main_error, main_output, only_run_dir, read_scalars

from cleanrl_ddp import evaluate
from cleanrl_ddp.runtime import RunError
from cleanrl_ddp.td3_continuous_action_multigpu import Args, derive_sizes

SCRIPT = "td3_continuous_action_multigpu.py"


def test_sizes_keep_cleanrls_replay_ratio_by_default():
    """One update per iteration: 256 sampled transitions per env step at any world size; the batch grows."""
    for world_size in (1, 2, 8):
        sizes = derive_sizes(Args(), world_size)
        assert sizes.batch_size == 256 * world_size and sizes.local_buffer_size == 1000000 // world_size
        assert sizes.replay_ratio == 256 and sizes.updates_per_env_step == 1 / world_size
    sizes = derive_sizes(Args(local_batch_size=128, updates_per_iteration=2), 2)  # CleanRL's update on 2 ranks
    assert (sizes.batch_size, sizes.replay_ratio, sizes.updates_per_env_step) == (256, 256, 1)
    assert derive_sizes(Args(), 3).local_buffer_size == 333333  # rounded down: CleanRL's default on 3 ranks
    with pytest.raises(RunError, match="--buffer-size 3 leaves 1 transitions to each of 2 ranks"):
        derive_sizes(Args(buffer_size=3), 2)
    with pytest.raises(RunError, match="--policy-frequency must be at least 1"):
        derive_sizes(Args(policy_frequency=0), 1)


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (["--env-id", "CartPole-v1"], r"CartPole-v1 has a Discrete action space; this script needs a Box one"),
    ],
    ids=["discrete-env"],
)
def test_bad_input_is_one_line(tmp_path, monkeypatch, flags, pattern):
    assert re.search(pattern, main_error(monkeypatch, SCRIPT, *flags, "--runs-dir", tmp_path))  # in this process
    assert not any(tmp_path.iterdir())


def test_learns_pendulum(tmp_path, monkeypatch, capsys):
    """One rank x 2 envs in this process (helpers.main_output), one update per global step of a global batch of 64
    (CleanRL's 256 costs as many updates, each slower): the global sizes of 2 ranks x 1 env, whose updates
    tests/test_distributed_correctness.py proves equal to this process's on the union of their batches (one process
    costs half the CPU of two on this small network). The actor, evaluated every 500 steps, swings the pendulum up (a
    random policy scores about -1,200) within 10k steps, and --target-return stops the run there; the evaluate command
    plays the checkpoint through the script's evaluation interface. A learning rate of 1e-3, not CleanRL's 3e-4: seeds
    1, 2 and 3 reach -400 at 6,000, 6,500 and 6,500 steps (at 3e-4: 7,000, 8,000 and 9,000), the updates costing
    this test most of its CPU."""
    flags = ["--env-id", "Pendulum-v1", "--total-timesteps", 10000, "--learning-starts", 1000, "--local-num-envs", 2]
    flags += ["--local-batch-size", 64, "--updates-per-iteration", 2, "--learning-rate", 1e-3]
    flags += ["--eval-every", 500, "--eval-episodes", 4]
    out = main_output(monkeypatch, capsys, SCRIPT, *flags, "--target-return", -400, "--runs-dir", tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    *_, (step, evaluated) = scalars["eval/episodic_return"]
    assert evaluated >= -400 and f"reached --target-return -400.0 at global step {step};" in out, scalars
    ckpt = torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=True)  # data only, saved at the stop
    assert ckpt["global_step"] == step and ckpt["agent_kwargs"]["action_high"] == [2.0]
    # critic updates from global step 1000, two per iteration of 2 steps; the actor after every 2nd
    assert (ckpt["num_updates"], ckpt["num_actor_updates"]) == (step - 1000, (step - 1000) // 2)

    capsys.readouterr()  # the evaluate command's main(), in this process (the command: tests/test_evaluation.py)
    assert evaluate.main([str(only_run_dir(tmp_path)), "--episodes", "2"]) == 0
    out = capsys.readouterr().out
    assert f"td3_continuous_action_multigpu Pendulum-v1 at global step {step}: return " in out
    assert "over 2 greedy episodes" in out
