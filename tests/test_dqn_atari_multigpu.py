"""dqn_atari_multigpu.py: the frame replay buffer against hand-built sequences, the schedules, a resume that refills
the buffer, bad input. Its 2-rank runs: tests/test_distributed_correctness.py (identical online and target networks on
every rank, updates and target syncs on the global step), tests/test_evaluation.py (the broadcast stop)."""

import dataclasses
from collections import deque

import numpy as np
import pytest
import torch
from helpers import main_error, main_output, only_run_dir, read_scalars

from cleanrl_ddp.atari import ale_game
from cleanrl_ddp.dqn_atari_multigpu import Args, derive_sizes, life_lost, linear_schedule, td_loss
from cleanrl_ddp.replay import FrameReplayBuffer

SCRIPT = "dqn_atari_multigpu.py"
# 2 envs per rank; updates every 8 global steps after step 100, a target sync every 64 global steps
TINY = ["--local-num-envs", "2", "--buffer-size", "400", "--learning-starts", "100", "--train-frequency", "8"]
TINY += ["--target-network-frequency", "64", "--log-every", "32", "--exploration-fraction", "0.5"]


def frame(value):
    return np.full((1, 1, 1), value, dtype=np.uint8)  # one env, a 1x1 "frame" holding its id


def stacks(obs):
    return obs[:, :, 0, 0].tolist()  # [B, 4, 1, 1] -> the frame ids of each stack


def test_buffer_rebuilds_stacks_across_episode_boundaries():
    rb = FrameReplayBuffer(capacity=16, num_envs=1, frame_shape=(1, 1))
    # game A: obs 1..5, the step from 4 ends the game (terminated), 5 is its final obs (the env then
    # resets instead of acting); game B: obs 11, 12, 13 (13 not yet followed by a step)
    steps = [(1, True, False, False), (2, False, False, False), (3, False, False, False), (4, False, True, False)]
    steps += [(5, False, False, True), (11, True, False, False), (12, False, False, False), (13, False, False, False)]
    for action, (value, first, terminated, final) in enumerate(steps):
        rb.add(frame(value), action, float(value), terminated, first, final)
    env = np.zeros(4, dtype=np.int64)
    t = rb.transitions(env, np.array([0, 3, 5, 6]))
    assert stacks(t["obs"]) == [[0, 0, 0, 1], [1, 2, 3, 4], [0, 0, 0, 11], [0, 0, 11, 12]]
    assert stacks(t["next_obs"]) == [[0, 0, 1, 2], [2, 3, 4, 5], [0, 0, 11, 12], [0, 11, 12, 13]]
    assert t["terminated"].tolist() == [False, True, False, False]
    assert t["actions"].tolist() == [0, 3, 5, 6] and t["rewards"].tolist() == [1.0, 4.0, 11.0, 12.0]
    # sampling never starts at game A's final obs (slot 4) nor at the newest slot (no next_obs yet)
    sampled = rb.sample(2000, np.random.RandomState(0))
    starts = {s[-1] for s in stacks(sampled["obs"])}
    assert starts == {1, 2, 3, 4, 11, 12}


def test_buffer_life_loss_terminates_but_keeps_the_stack():
    rb = FrameReplayBuffer(capacity=8, num_envs=1, frame_shape=(1, 1))
    for value in range(1, 7):  # a life is lost on the step from obs 3: the game (and the stack) goes on
        rb.add(frame(value), 0, 0.0, value == 3, value == 1, False)
    t = rb.transitions(np.zeros(2, dtype=np.int64), np.array([2, 3]))
    assert stacks(t["obs"]) == [[0, 1, 2, 3], [1, 2, 3, 4]]
    assert stacks(t["next_obs"]) == [[1, 2, 3, 4], [2, 3, 4, 5]]
    assert t["terminated"].tolist() == [True, False]


def test_buffer_wrap_around():
    rb = FrameReplayBuffer(capacity=6, num_envs=1, frame_shape=(1, 1))
    for value in range(1, 10):  # one game, obs 1..9; the ring holds 4..9 in physical slots 3,4,5,0,1,2
        rb.add(frame(value), value, 0.0, False, value == 1, False)
    assert rb.size == 6 and rb.pos == 3
    assert rb.frames[0, :, 0, 0].tolist() == [7, 8, 9, 4, 5, 6]
    t = rb.transitions(np.zeros(2, dtype=np.int64), np.array([0, 1]))  # obs 7 and 8: stacks cross the seam
    assert stacks(t["obs"]) == [[4, 5, 6, 7], [5, 6, 7, 8]]
    assert stacks(t["next_obs"]) == [[5, 6, 7, 8], [6, 7, 8, 9]]
    # only 7 and 8 are complete: 4..6 would need overwritten frames 1..3, and 9 has no next_obs yet
    sampled = rb.sample(1000, np.random.RandomState(0))
    assert {s[-1] for s in stacks(sampled["obs"])} == {7, 8}
    assert sampled["actions"].tolist() == [s[-1] for s in stacks(sampled["obs"])]


def test_buffer_matches_the_env_stacks_on_a_long_random_sequence():
    # Simulate 3 envs in lockstep the way the training loop feeds the buffer (random game lengths, life
    # losses, wrap-around many times) and record the stack the agent saw at every step: every sampled
    # (obs, next_obs) must be exactly the stacks the agent saw at that step and the step after.
    rng = np.random.default_rng(0)
    num_envs, capacity = 3, 20
    rb = FrameReplayBuffer(capacity=capacity, num_envs=num_envs, frame_shape=(1, 1))
    seen = {}  # frame id -> (stack the agent saw, next stack, terminated)
    windows = [deque([0, 0, 0, 0], maxlen=4) for _ in range(num_envs)]
    first, final = np.ones(num_envs, dtype=bool), np.zeros(num_envs, dtype=bool)
    next_id = 1
    prev = [None] * num_envs
    for _step in range(200):
        ids = np.zeros(num_envs, dtype=np.int64)
        for e in range(num_envs):
            if first[e]:
                windows[e].extend([0, 0, 0])
            ids[e] = next_id % 250 + 1  # frame ids repeat (uint8), but never within one ring
            next_id += 1
            windows[e].append(ids[e])
            if prev[e] is not None:
                seen[prev[e][0]] = (prev[e][1], list(windows[e]), prev[e][2])
        game_over = (rng.random(num_envs) < 0.1) & ~final
        terminated = (game_over | (rng.random(num_envs) < 0.1)) & ~final
        rb.add(ids.astype(np.uint8).reshape(num_envs, 1, 1), 0, 0.0, terminated, first, final)
        for e in range(num_envs):
            prev[e] = None if final[e] else (int(ids[e]), list(windows[e]), bool(terminated[e]))
        first, final = final, game_over
        sampled = rb.sample(64, np.random.RandomState(_step)) if _step >= 1 else None
        if sampled is not None:
            for obs, next_obs, term in zip(
                stacks(sampled["obs"]), stacks(sampled["next_obs"]), sampled["terminated"], strict=True
            ):
                assert (obs, next_obs, bool(term)) == seen[obs[-1]]


def test_schedules_and_helpers():  # (the periodic schedule, rt.steps_crossed: tests/test_runtime.py)
    assert linear_schedule(1.0, 0.01, 100, 0) == 1.0
    assert linear_schedule(1.0, 0.01, 100, 50) == pytest.approx(0.505)
    assert linear_schedule(1.0, 0.01, 100, 1000) == 0.01
    assert life_lost(np.array([4, 0, 5, 3]), np.array([5, 1, 5, 0])).tolist() == [True, False, False, False]
    for env_id in ("BreakoutNoFrameskip-v4", "ALE/Breakout-v5", "Breakout", "breakout"):
        assert ale_game(env_id) == "breakout"
    assert ale_game("MsPacmanNoFrameskip-v4") == "ms_pacman" and ale_game("ALE/SpaceInvaders-v5") == "space_invaders"


def test_td_loss_matches_hand_computation():
    q_values = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    target_q = torch.tensor([[3.0, 4.0], [10.0, 0.0]])
    model = lambda obs: q_values  # stands in for the online network
    target = lambda obs: target_q
    loss, q_mean = td_loss(
        model, target, None, torch.tensor([1, 0]), torch.tensor([1.0, -1.0]), None, torch.tensor([0.0, 1.0]), 0.9
    )
    # targets: 1 + 0.9 * 4 = 4.6 (bootstrapped), -1 (terminated); taken Q values: 2.0 and 0.5
    assert loss.item() == pytest.approx(((4.6 - 2.0) ** 2 + (-1.0 - 0.5) ** 2) / 2)
    assert q_mean.item() == pytest.approx(1.25)


def test_derived_sizes():
    args = Args(local_num_envs=4, buffer_size=1000, local_batch_size=32, train_frequency=4, total_timesteps=1000)
    assert dataclasses.asdict(derive_sizes(args, 2)) == dict(
        world_size=2,
        num_envs=8,
        batch_size=64,
        local_buffer_size=500,
        env_buffer_capacity=125,
        num_iterations=125,
        replay_ratio=16.0,
    )
    # a share that does not divide is rounded down (the table shows it): CleanRL's 1M frames on 3 ranks
    sizes = derive_sizes(dataclasses.replace(args, buffer_size=1001), 2)
    assert (sizes.env_buffer_capacity, sizes.local_buffer_size) == (125, 500)
    sizes = derive_sizes(Args(), 3)
    assert (sizes.env_buffer_capacity, sizes.local_buffer_size) == (333333, 333333)
    with pytest.raises(ValueError, match="leaves 5 slots per env"):
        derive_sizes(dataclasses.replace(args, buffer_size=40), 2)
    fields = {f.name for f in dataclasses.fields(Args)}
    assert not fields & {"num_envs", "batch_size", "local_buffer_size", "num_iterations", "world_size"}


def test_resume_refills_the_buffer_then_continues(tmp_path, monkeypatch, capsys):
    # a finished 1-process run (128 steps, 4 updates), resumed to 256 steps: the replay memory is not saved,
    # so updates restart --learning-starts (100) steps after the checkpoint, at 232, 240, 248 and 256; both in this
    # process (helpers.main_output), as the plain-python command runs them
    main_output(monkeypatch, capsys, SCRIPT, *TINY, "--runs-dir", tmp_path, "--total-timesteps", 128)
    run_dir = only_run_dir(tmp_path)
    again = main_output(monkeypatch, capsys, SCRIPT, "--resume", run_dir, "--total-timesteps", 256)
    assert "resuming at iteration 65, global step 128" in again
    assert "updates restart at global step 228 (buffer refill)" in again
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert ckpt["global_step"] == 256 and ckpt["num_updates"] == 8
    # every logged step once (purge_step), counts carried over; by step, as test_ppo_multigpu.py's resume test says
    updates = sorted(read_scalars(run_dir)["charts/updates"])
    assert [s for s, _ in updates] == list(range(32, 257, 32))
    assert [v for _, v in updates] == [0, 0, 0, 4, 4, 4, 4, 8]
    files = sorted(p.name for p in run_dir.iterdir())
    done = main_error(monkeypatch, SCRIPT, "--resume", run_dir)  # a finished run: refused in this process
    assert "has finished: its checkpoint is at global step 256" in done
    assert sorted(p.name for p in run_dir.iterdir()) == files  # nothing written


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--env-id", "NoSuchGameNoFrameskip-v4"], "unknown --env-id 'NoSuchGameNoFrameskip-v4': not an ALE game"),
        (["--buffer-size", "4"], "leaves 4 slots per env"),
        (["--target-return", "10"], "--target-return needs --eval-every"),
    ],
    ids=["unknown-env", "tiny-buffer", "target-without-eval"],
)
def test_bad_input_is_one_clear_line(tmp_path, monkeypatch, args, pattern):
    assert pattern in main_error(monkeypatch, SCRIPT, *args, "--runs-dir", tmp_path)  # in this process
    assert not any(tmp_path.iterdir())  # nothing written
