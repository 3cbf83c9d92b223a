"""ppo_atari_async_multigpu.py: its overlapped rollout fills the same buffer as the synchronous script's
(both real `main()`s, same seeds, a deterministic policy). Its 2-rank runs: tests/test_distributed_correctness.py (every
rank identical at every iteration, global steps and checkpoint), tests/test_fault_tolerance.py (SIGTERM, resume)."""

import os
import signal
import sys

import pytest
import torch
from helpers import read_scalars

import cleanrl_ddp.ppo_atari_async_multigpu as async_script
import cleanrl_ddp.ppo_atari_multigpu as sync_script
from cleanrl_ddp import runtime as rt

SCRIPT = "ppo_atari_async_multigpu.py"


def deterministic(agent_cls):
    """The script's own Agent, acting by a fixed function of the frames in the rollout (no sampling), so that
    two runs with the same seeds play the same games whatever order the envs' steps are computed in."""

    class Deterministic(agent_cls):
        def get_action_and_value(self, x, action=None):
            if action is not None:
                return super().get_action_and_value(x, action)
            still = (x[:, -1] == x[:, -2]).flatten(1).all(1)  # a new life waits for FIRE (action 1)
            action = torch.where(still, 1, x.flatten(1).sum(1) % self.actor.out_features)  # exact integer sums
            return action, -0.1 * action.float(), torch.zeros(len(x), device=x.device), self.get_value(x)

        def get_value(self, x):
            return (x.flatten(1).sum(1).double() / (255 * x[0].numel())).float().unsqueeze(1)

    return Deterministic


def rollouts_of(module, monkeypatch, tmp_path, argv) -> list[dict]:
    """Run `module.main()` in this process and return, per iteration, what GAE and the update received."""
    seen = []

    def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
        buffers = dict(rewards=rewards, values=values, dones=dones, next_value=next_value, next_done=next_done)
        seen.append({k: v.detach().cpu().clone() for k, v in buffers.items()})
        return gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda)

    def ppo_loss(model, mb_advantages, mb_obs, mb_actions, mb_logprobs, mb_returns, mb_values, args):
        # one minibatch, one epoch, identity permutation: the minibatch is the flattened buffer, in order
        seen[-1] |= dict(obs=mb_obs.cpu().clone(), actions=mb_actions.cpu().clone(), logprobs=mb_logprobs.cpu().clone())
        zero = sum(p.sum() for p in model.parameters()) * 0  # no learning: keeps the test fast
        return zero, dict(policy_loss=zero.detach(), value_loss=zero.detach())

    gae = module.compute_gae
    monkeypatch.setattr(module, "compute_gae", compute_gae)
    monkeypatch.setattr(module, "ppo_loss", ppo_loss)
    monkeypatch.setattr(module, "Agent", deterministic(module.Agent))
    monkeypatch.setattr(torch, "randperm", lambda n, device=None: torch.arange(n, device=device))
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv, "--runs-dir", str(tmp_path), "--run-name", "run"])
    handlers, threads = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}, torch.get_num_threads()
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, [min(cores)])  # one core, so one torch thread: two crawl on a shared 2-core machine
    try:
        module.main()
    finally:  # main() installs its preemption handlers and sets torch's threads; give this process its own back
        os.sched_setaffinity(0, cores)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.set_num_threads(threads)
    return seen


def test_overlapped_rollout_fills_the_same_buffer_as_the_synchronous_one(tmp_path, monkeypatch):
    # 5 envs: halves of 2 and 3; 2 iterations of 128 steps: life losses and whole games end inside rollouts
    envs, steps, iterations = 5, 128, 2
    argv = ["--local-num-envs", envs, "--num-steps", steps, "--num-minibatches", 1, "--update-epochs", 1]
    argv = [str(a) for a in argv + ["--total-timesteps", iterations * envs * steps, "--checkpoint-every", 0]]
    sync = rollouts_of(sync_script, monkeypatch, tmp_path / "sync", argv)
    overlapped = rollouts_of(async_script, monkeypatch, tmp_path / "async", argv)
    assert len(sync) == len(overlapped) == iterations
    for it, (expected, got) in enumerate(zip(sync, overlapped, strict=True)):
        assert expected.keys() == got.keys()
        for name in expected:
            assert torch.equal(expected[name], got[name]), f"iteration {it + 1}: {name} differs"
    dones = torch.stack([r["dones"] for r in sync])
    assert dones.sum() > 0 and torch.stack([r["rewards"] for r in sync]).abs().sum() > 0  # not a trivial rollout
    assert len(set(sync[0]["actions"].tolist())) == 4  # every action taken
    logged = [read_scalars(tmp_path / name / "run") for name in ("sync", "async")]
    for tag in ("charts/episodes", "charts/episodic_return", "charts/episodic_length"):
        assert tag in logged[0] and logged[0][tag] == logged[1][tag], tag  # whole games, counted per half
    assert sum(v for _, v in logged[0]["charts/episodes"]) >= 1


def test_halves_split_every_env_once():
    assert async_script.halves(8) == (slice(0, 4), slice(4, 8))
    assert async_script.halves(5) == (slice(0, 2), slice(2, 5))
    with pytest.raises(rt.RunError, match="at least 2"):
        async_script.derive_sizes(async_script.Args(local_num_envs=1), world_size=2)
