"""pqn_multigpu.py and pqn_atari_multigpu.py: sizes from the world size and the Q(lambda) returns against
hand-computed values, in process. The distributed guarantees are in tests/test_distributed_correctness.py (SCRIPTS
in tests/script_specs.py), resume in tests/test_fault_tolerance.py, evaluation in tests/test_evaluation.py."""

import dataclasses
import importlib

import pytest
import torch

SCRIPTS = ["pqn_multigpu", "pqn_atari_multigpu"]


@pytest.fixture(params=SCRIPTS)
def script(request):
    return importlib.import_module(f"cleanrl_ddp.{request.param}")


def test_derived_sizes_follow_world_size(script):
    args = script.Args(local_num_envs=4, num_steps=128, num_minibatches=4, total_timesteps=10_000)
    assert dataclasses.asdict(script.derive_sizes(args, 2)) == dict(
        world_size=2,
        num_envs=8,
        local_batch_size=512,
        batch_size=1024,
        local_minibatch_size=128,
        minibatch_size=256,
        num_iterations=9,
    )
    assert script.derive_sizes(args, 3).num_iterations == 6
    fields = {f.name for f in dataclasses.fields(script.Args)}
    assert not fields & {"num_envs", "batch_size", "local_batch_size", "minibatch_size", "num_iterations"}


def test_q_lambda_returns_match_hand_computation(script):
    """One env, three steps; obs[2] starts a new episode (dones[2] = 1), so step 1's return is its reward alone."""
    gamma, lam = 0.9, 0.5
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[0.5], [1.0], [1.5]])  # max_a Q(obs[t], a)
    dones = torch.tensor([[0.0], [0.0], [1.0]])
    next_value, next_done = torch.tensor([2.0]), torch.tensor([0.0])
    returns = script.q_lambda_returns(rewards, values, dones, next_value, next_done, gamma, lam)
    r2 = 3.0 + gamma * 2.0  # bootstraps from max Q of the observation after the rollout
    r1 = 2.0  # the episode ended: no bootstrap
    r0 = 1.0 + gamma * (lam * r1 + (1 - lam) * 1.0)  # lambda mixes the next return and the next max Q
    assert torch.allclose(returns.flatten(), torch.tensor([r0, r1, r2]))
    # lambda 0: one-step Q-learning targets; lambda 1: discounted returns bootstrapped at the end
    no_done = torch.zeros(3, 1)
    one_step = script.q_lambda_returns(rewards, values, no_done, next_value, next_done, gamma, 0.0)
    assert torch.allclose(one_step.flatten(), torch.tensor([1.0 + 0.9 * 1.0, 2.0 + 0.9 * 1.5, 3.0 + 0.9 * 2.0]))
    monte_carlo = script.q_lambda_returns(rewards, values, no_done, next_value, next_done, gamma, 1.0)
    assert monte_carlo[0].item() == pytest.approx(1.0 + 0.9 * 2.0 + 0.81 * 3.0 + 0.729 * 2.0)


def test_epsilon_falls_over_the_global_steps(script):
    args = script.Args(total_timesteps=1000)
    duration = args.exploration_fraction * args.total_timesteps
    at = [script.linear_schedule(args.start_e, args.end_e, duration, t) for t in (0, duration / 2, duration, 1000)]
    assert at == pytest.approx([1.0, (1.0 + args.end_e) / 2, args.end_e, args.end_e])
