"""ppo_atari_multigpu.py: the env wrapper facts (frames, reward clipping, life loss vs game over),
env ids, the frames' way to the device, and a run that logs whole-game returns."""

import re

import numpy as np
import pytest
import torch
from helpers import main_error, main_output, only_run_dir, read_scalars

from cleanrl_ddp import runtime as rt
from cleanrl_ddp.atari import ale_game, clip_reward, game_over, sticky_action_probability
from cleanrl_ddp.ppo_atari_multigpu import Agent, Args, make_env

SCRIPT = "ppo_atari_multigpu.py"


def test_frames_are_stacked_84x84_uint8():
    envs = make_env("BreakoutNoFrameskip-v4", 2)
    obs, info = envs.reset(seed=np.arange(2))
    assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
    assert envs.single_action_space.n == 4
    assert list(info["lives"]) == [5, 5]
    envs.close()


def test_frames_reach_the_device_through_a_staging_buffer_of_their_shape():
    # The rollout's one code path (CPU and CUDA): the env's NCHW frames [envs, 4, 84, 84] uint8 go into a
    # host buffer of their own shape (page-locked on CUDA), then to the device. On CPU the result is the
    # buffer itself, so each call must give that call's frames.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pin = device.type == "cuda"
    envs = make_env("breakout", 3)
    reset_frames, _ = envs.reset(seed=np.arange(3))
    staging = torch.zeros(reset_frames.shape, dtype=torch.uint8, pin_memory=pin)  # as the script makes it
    envs.close()
    rng = np.random.default_rng(0)
    for frames in [reset_frames, *(rng.integers(0, 256, (3, 4, 84, 84), dtype=np.uint8) for _ in range(2))]:
        on_device = rt.to_device(frames, device, staging)
        assert on_device.device.type == device.type and on_device.dtype == torch.uint8
        assert torch.equal(on_device.cpu(), torch.from_numpy(frames))


def test_rewards_are_clipped_for_learning_only():
    # the env returns game points (Breakout's rows give 1, 4 and 7), which the logged score sums;
    # learning sees their sign
    assert clip_reward(np.array([0.0, 1.0, 4.0, 7.0, -3.0])).tolist() == [0.0, 1.0, 1.0, 1.0, -1.0]
    assert clip_reward(np.zeros(3)).dtype == np.float32


def test_bf16_autocast_keeps_heads_in_float32():
    torch.manual_seed(0)
    agent = Agent(4).to(memory_format=torch.channels_last)
    frames = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        action, logprob, entropy, value = agent.get_action_and_value(frames)
    assert logprob.dtype == entropy.dtype == value.dtype == torch.float32
    _, logprob32, _, value32 = agent.get_action_and_value(frames, action)
    assert torch.allclose(logprob, logprob32, atol=0.05) and torch.allclose(value, value32, atol=0.05)


def test_life_loss_is_a_learning_boundary_not_a_game_end():
    envs = make_env("breakout", 1)
    _, info = envs.reset(seed=np.array([3]))
    prev_lives, prev_frame = info["lives"], info["episode_frame_number"]
    rng = np.random.default_rng(0)
    life_losses, games = 0, 0
    for _ in range(3000):
        _, _, term, trunc, info = envs.step(rng.integers(0, 4, size=1))
        over = game_over(term, trunc, info["lives"], prev_lives)
        if term[0] and not over[0]:
            life_losses += 1
            assert info["lives"][0] == prev_lives[0] - 1  # one life fewer ...
            assert info["episode_frame_number"][0] > prev_frame[0]  # ... and the same game goes on
        if over[0]:
            games += 1
            assert info["lives"][0] == 5 and info["episode_frame_number"][0] < prev_frame[0]  # a new game
            if games == 2:
                break
        prev_lives, prev_frame = info["lives"], info["episode_frame_number"]
    envs.close()
    assert games == 2 and life_losses == 8  # 5 lives: 4 life losses, then the game over, twice


@pytest.mark.parametrize(
    "env_id, game",
    [
        ("BreakoutNoFrameskip-v4", "breakout"),
        ("ALE/Breakout-v5", "breakout"),
        ("breakout", "breakout"),
        ("MsPacmanNoFrameskip-v4", "ms_pacman"),
        ("ALE/SpaceInvaders-v5", "space_invaders"),
    ],
)
def test_env_ids_name_ale_games(env_id, game):
    assert ale_game(env_id) == game


def test_unknown_game_names_valid_examples():
    with pytest.raises(ValueError, match="BreakoutNoFrameskip-v4.*ALE/Pong-v5"):
        ale_game("NoSuchGame-v4")


def test_sticky_actions_follow_the_id_protocol():
    assert sticky_action_probability(Args(env_id="BreakoutNoFrameskip-v4")) == 0.0
    assert sticky_action_probability(Args(env_id="ALE/Breakout-v5")) == 0.25
    assert sticky_action_probability(Args(env_id="ALE/Breakout-v5", repeat_action_probability=0.0)) == 0.0


# 2 envs x 128 steps per iteration: random Breakout games last 120-250 steps, so games end. In this process
# (helpers.main_output); the 2-rank runs: tests/test_distributed_correctness.py (global steps, episodes reduced over
# the ranks).
def test_training_runs_and_logs_whole_games(tmp_path, monkeypatch, capsys):
    iterations, local_envs, steps = 2, 2, 128
    tiny = ["--local-num-envs", local_envs, "--num-steps", steps, "--num-minibatches", 2, "--update-epochs", 1]
    total = iterations * local_envs * steps
    main_output(monkeypatch, capsys, SCRIPT, *tiny, "--total-timesteps", total, "--runs-dir", tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    steps_logged = [s for s, _ in scalars["losses/value_loss"]]
    assert steps_logged == [i * local_envs * steps for i in range(1, iterations + 1)]
    assert all(v == 2 for _, v in scalars["charts/updates_per_iteration"])
    assert all(np.isfinite(v) for _, v in scalars["losses/policy_loss"])
    assert "charts/SPS" in scalars
    # whole games: 5 lives of a random player take far more than the ~20-40 steps of one life
    lengths = [v for _, v in scalars["charts/episodic_length"]]
    returns = [v for _, v in scalars["charts/episodic_return"]]
    assert lengths and min(lengths) > 60, lengths
    assert all(r >= 0 for r in returns), returns
    assert (only_run_dir(tmp_path) / "checkpoint.pt").is_file()


def test_unknown_env_id_is_one_clear_line(tmp_path, monkeypatch):
    message = main_error(monkeypatch, SCRIPT, "--env-id", "Pacmann-v5", "--runs-dir", tmp_path)  # in this process
    assert re.search("unknown --env-id 'Pacmann-v5'.*BreakoutNoFrameskip-v4", message)
    assert not any(tmp_path.iterdir())
