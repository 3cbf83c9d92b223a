"""PQN (Gallici et al., 2024) for discrete actions (classic control), data-parallel.

Docs: docs/pqn_multigpu.md. Launch it (every rank runs this file; more ways in the README):

    python cleanrl_ddp/pqn_multigpu.py                                    # 1 process
    torchrun --standalone --nproc_per_node=2 cleanrl_ddp/pqn_multigpu.py  # 2 processes, one machine

CleanRL's `pqn.py` (no replay, no target network). Each rank computes the Q(lambda) returns of its own
envs; gradients are averaged across ranks, then clipped.
"""

import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tyro
from torch.nn.parallel import DistributedDataParallel as DDP

from cleanrl_ddp import checkpoint, env_state, evals, graphs
from cleanrl_ddp import runtime as rt

SCRIPT = os.path.basename(__file__)[: -len(".py")]


@dataclass
class Args(rt.RunArgs):
    exp_name: str = SCRIPT
    """the name of this experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""

    # Algorithm specific arguments
    env_id: str = "CartPole-v1"
    """the id of a gymnasium env with discrete actions"""
    total_timesteps: int = 500000
    """total env steps, summed over all ranks"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    local_num_envs: int = 4
    """the number of parallel envs on each rank"""
    num_steps: int = 128
    """the number of steps per env per rollout"""
    num_minibatches: int = 4
    """the number of minibatches per epoch, on every rank"""
    update_epochs: int = 4
    """the K epochs to update the Q-network"""
    anneal_lr: bool = True
    """toggle learning rate annealing"""
    gamma: float = 0.99
    """the discount factor gamma"""
    start_e: float = 1
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.5
    """the fraction of `total-timesteps` it takes from start-e to end-e"""
    max_grad_norm: float = 10.0
    """the maximum norm for gradient clipping (of the averaged gradient)"""
    q_lambda: float = 0.65
    """the lambda of the Q(lambda) returns"""
    eval_greedy: bool = True
    """if toggled, evaluation is greedy, else epsilon-greedy with --end-e"""
    grad_sync: Literal["ddp", "flat"] = "ddp"
    """how gradients are averaged: DDP, or one flat all-reduce"""
    cudagraphs: bool = True
    """on CUDA, replay the policy step and the Q(lambda) returns as CUDA graphs"""


def make_env(env_id: str, render_mode: Optional[str] = None):
    def thunk():
        return gym.make(env_id, render_mode=render_mode)

    return thunk


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


# ALGO LOGIC: initialize agent here:
class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 120)),
            nn.LayerNorm(120),  # per-sample statistics: nothing to sync across ranks
            nn.ReLU(),
            layer_init(nn.Linear(120, 84)),
            nn.LayerNorm(84),
            nn.ReLU(),
            layer_init(nn.Linear(84, n_actions)),
        )

    def forward(self, x):
        return self.network(x)


def eval_action(q_network: QNetwork, obs, greedy: bool, generator, args: Args):
    q_values = q_network(obs)
    epsilon = 0.0 if greedy else args.end_e
    explore = torch.rand(len(obs), generator=generator, device=obs.device) < epsilon
    random = torch.randint(q_values.shape[1], (len(obs),), generator=generator, device=obs.device)
    return torch.where(explore, random, q_values.argmax(dim=1))


def load_agent(ckpt: dict, device) -> QNetwork:
    q_network = QNetwork(**ckpt["agent_kwargs"]).to(device)
    q_network.load_state_dict(ckpt["q_network"])
    return q_network


# ALGO LOGIC: sizes, epsilon, Q(lambda), the update, the all-reduce
@dataclass(frozen=True)
class Sizes(rt.Sizes):
    local_batch_size: int
    local_minibatch_size: int
    minibatch_size: int


def derive_sizes(args: Args, world_size: int) -> Sizes:
    rt.require_at_least_1(args, "local_num_envs", "num_steps", "num_minibatches", "update_epochs", "total_timesteps")
    local_batch_size = args.local_num_envs * args.num_steps
    if local_batch_size % args.num_minibatches != 0:
        raise rt.RunError(
            f"the local batch (--local-num-envs {args.local_num_envs} x --num-steps {args.num_steps} = "
            f"{local_batch_size}) does not divide into --num-minibatches {args.num_minibatches}"
        )
    batch_size = local_batch_size * world_size
    num_iterations = args.total_timesteps // batch_size
    if num_iterations < 1:
        raise rt.RunError(
            f"--total-timesteps {args.total_timesteps} is smaller than one iteration's global batch "
            f"({world_size} ranks x {args.local_num_envs} envs x {args.num_steps} steps = {batch_size})"
        )
    return Sizes(
        world_size=world_size,
        num_envs=args.local_num_envs * world_size,
        batch_size=batch_size,
        num_iterations=num_iterations,
        local_batch_size=local_batch_size,
        local_minibatch_size=local_batch_size // args.num_minibatches,
        minibatch_size=batch_size // args.num_minibatches,
    )


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def q_lambda_returns(rewards, values, dones, next_value, next_done, gamma, q_lambda):
    """Q(lambda) returns of a [num_steps, num_envs] rollout; `values[t]` is max_a Q(obs[t], a)."""
    num_steps = rewards.shape[0]
    returns = torch.zeros_like(rewards)
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            returns[t] = rewards[t] + gamma * next_value * (1.0 - next_done)
        else:
            nextnonterminal = 1.0 - dones[t + 1]
            mixed = q_lambda * returns[t + 1] + (1 - q_lambda) * values[t + 1]
            returns[t] = rewards[t] + gamma * mixed * nextnonterminal
    return returns


def update_q_network(model, q_network, optimizer, obs, actions, returns, args: Args, world_size: int):
    """One update on this rank's minibatch; `model` may be DDP."""
    q_taken = model(obs).gather(1, actions.unsqueeze(1)).squeeze(1)
    loss = F.mse_loss(q_taken, returns)
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    if world_size > 1 and args.grad_sync == "flat":
        all_reduce_gradients_flat(list(q_network.parameters()), world_size)
    # CRUCIAL: clip the AVERAGED gradient, so every rank clips the same vector
    nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)
    optimizer.step()
    return loss.detach(), q_taken.mean().detach()


def all_reduce_gradients_flat(params, world_size: int) -> None:
    """Average gradients over ranks in one flat all-reduce (entity-neural-network/incubator#220)."""
    if world_size == 1:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def main() -> None:
    args = tyro.cli(Args)
    run = rt.start(args, SCRIPT)
    args, ckpt = rt.load_run(run, args, required=("q_network", "optimizer", "agent_kwargs"))
    rank, world_size, device = run.rank, run.world_size, run.device
    rt.check_env(args.env_id, make_env, gym.spaces.Discrete, hint="PQN needs discrete actions; try CartPole-v1")
    sizes = derive_sizes(args, world_size)
    start_iteration = ckpt["iteration"] + 1 if ckpt else 1
    global_step = ckpt["global_step"] if ckpt else 0

    # CRUCIAL: the same start weights on every rank; each rank's own (disjoint) env seeds and random stream
    rt.seed_everything(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id) for _ in range(args.local_num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    n_actions = int(envs.single_action_space.n)
    agent_kwargs = dict(obs_dim=int(np.prod(envs.single_observation_space.shape)), n_actions=n_actions)
    q_network = QNetwork(**agent_kwargs).to(device)
    if world_size > 1:
        for tensor in q_network.state_dict().values():  # the same start on either --grad-sync
            dist.broadcast(tensor, src=0)
    # foreach: CUDA's default, on the CPU too
    optimizer = checkpoint.refuse_misfit_state(optim.RAdam(q_network.parameters(), lr=args.learning_rate, foreach=True))
    rt.seed_everything(rt.rank_seed(args.seed, rank))
    if ckpt:
        q_network.load_state_dict(ckpt["q_network"])
        optimizer.load_state_dict(ckpt["optimizer"])
        rt.resume_rng(run, ckpt, args.seed)
    model = DDP(q_network) if world_size > 1 and args.grad_sync == "ddp" else q_network

    env_seed0 = args.seed + rank * args.local_num_envs
    next_obs_np, _ = envs.reset(seed=env_seed0)
    episodes = rt.Episodes(args.local_num_envs)
    next_done = np.zeros(args.local_num_envs)
    if ckpt:  # every env resumes where it was, whichever rank steps it now
        share = env_state.split_for_rank(run, ckpt)
        if env_state.restore(run, envs.envs, share[0] if share else None):
            next_obs_np, next_done, episodes.returns, episodes.lengths = (x.numpy() for x in share[1:])
        else:  # no state function: new episodes, from unused seeds
            next_obs_np, _ = envs.reset(seed=env_seed0 + (start_iteration - 1) * sizes.num_envs)

    # ALGO Logic: Storage setup, allocated once (a CUDA graph replays the addresses)
    n = args.local_num_envs
    obs_shape = envs.single_observation_space.shape
    obs = torch.zeros((args.num_steps, n) + obs_shape, device=device)
    actions = torch.zeros((args.num_steps, n), dtype=torch.long, device=device)
    values = torch.zeros((args.num_steps, n), device=device)
    host_rewards = torch.zeros((args.num_steps, n), pin_memory=run.on_cuda)
    host_dones = torch.zeros((args.num_steps + 1, n), pin_memory=run.on_cuda)  # last row: next_done
    host_dones[-1] = torch.from_numpy(next_done)
    host_epsilons = torch.zeros(args.num_steps, pin_memory=run.on_cuda)
    staging = torch.zeros((n,) + obs_shape, pin_memory=run.on_cuda)
    next_obs = staging.to(device)
    rewards = host_rewards.to(device)
    all_dones = host_dones.to(device)
    graphs.fill(next_obs, next_obs_np, staging)
    epsilons = host_epsilons.to(device)
    steps = torch.arange(args.num_steps, device=device)
    num_iterations = sizes.num_iterations
    preempted = False
    duration = args.exploration_fraction * args.total_timesteps

    def policy_step(step):
        """Epsilon-greedy into row `step` (a tensor: one graph for every row)."""
        # ALGO LOGIC: action logic (the unwrapped network: inference skips DDP)
        random_actions = torch.randint(0, n_actions, (n,), device=device)
        with torch.no_grad():
            q_max, max_actions = q_network(next_obs).max(dim=1)
        explore = torch.rand(n, device=device) < epsilons[step]
        values[step] = q_max
        actions[step] = torch.where(explore, random_actions, max_actions)

    def lambda_returns():
        with torch.no_grad():
            next_value = q_network(next_obs).max(dim=1).values
            dones, next_done = all_dones[:-1], all_dones[-1]
            return q_lambda_returns(rewards, values, dones, next_value, next_done, args.gamma, args.q_lambda)

    # --cudagraphs acts on CUDA only; the update stays eager (RAdam's capturable step computes otherwise)
    capture = graphs.enabled(args, run)
    policy_step = graphs.graphed(policy_step, capture)
    lambda_returns = graphs.graphed(lambda_returns, capture)
    rt.open_run(run, sizes, ckpt)

    for iteration in range(start_iteration, num_iterations + 1):
        rollout_start = time.perf_counter()
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        # ALGO LOGIC: each step's epsilon, from the GLOBAL step after it
        rollout_epsilons = [
            linear_schedule(args.start_e, args.end_e, duration, global_step + k * sizes.num_envs)
            for k in range(1, args.num_steps + 1)
        ]
        host_epsilons.numpy()[:] = rollout_epsilons
        epsilons.copy_(host_epsilons, non_blocking=True)
        host_dones[0] = host_dones[-1]
        for step in range(args.num_steps):
            global_step += sizes.num_envs  # global: all ranks step at once
            obs[step] = next_obs  # a copy: `next_obs` is refilled below
            policy_step(steps[step : step + 1])

            # TRY NOT TO MODIFY: execute the game and log data.
            next_obs_np, reward, terminations, truncations, _ = envs.step(actions[step].cpu().numpy())
            next_done = np.logical_or(terminations, truncations)
            episodes.step(reward, next_done)
            host_rewards[step] = torch.from_numpy(reward)
            host_dones[step + 1] = torch.from_numpy(next_done)
            graphs.fill(next_obs, next_obs_np, staging)

        rewards.copy_(host_rewards, non_blocking=True)
        all_dones.copy_(host_dones, non_blocking=True)
        update_start = time.perf_counter()
        returns = lambda_returns()

        # flatten the batch
        b_obs = obs.reshape((-1,) + obs_shape)
        b_actions = actions.reshape(-1)
        b_returns = returns.reshape(-1)

        # Optimizing the Q-network (the same all-reduces on every rank)
        td_loss = 0.0
        q_values = 0.0
        num_updates = 0
        for _epoch in range(args.update_epochs):
            b_inds = torch.randperm(sizes.local_batch_size, device=device).view(-1, sizes.local_minibatch_size)
            for mb_inds in b_inds:
                minibatch = [b[mb_inds] for b in (b_obs, b_actions, b_returns)]
                loss, q_mean = update_q_network(model, q_network, optimizer, *minibatch, args, world_size)
                td_loss = td_loss + loss
                q_values = q_values + q_mean
                num_updates += 1
        update_seconds = time.perf_counter() - update_start

        # metrics of ALL ranks in one all-reduce: losses averaged, episodes summed
        n_all = num_updates * world_size
        m = rt.all_sum(run, {"losses/td_loss": td_loss / n_all, "losses/q_values": q_values / n_all} | episodes.take())
        scalars = {
            "charts/learning_rate": optimizer.param_groups[0]["lr"],
            "charts/epsilon": rollout_epsilons[-1],
            **{k: v for k, v in m.items() if k.startswith("losses/")},
            # rank 0's wall time, waits for other ranks included
            "perf/rollout_seconds": update_start - rollout_start,
            "perf/update_seconds": update_seconds,
        }
        rt.log(run, global_step, scalars, m)
        prev_step = global_step - sizes.batch_size  # the periodic flags count global steps
        if rt.steps_crossed(prev_step, global_step, args.sync_check_every):
            rt.check_replicas_in_sync(f"iteration {iteration}", world_size, q_network, optimizer)
        reached = evals.evaluate(run, q_network, eval_action, make_env, prev_step, global_step)

        preempted = rt.preempted(run)  # a SIGTERM/SIGUSR1 on any rank stops every rank here
        last = iteration == num_iterations or preempted or reached
        if last or rt.steps_crossed(prev_step, global_step, args.checkpoint_every):
            # this rank's envs as data, not pickled
            env_states = [env_state.capture(env) for env in envs.envs]
            host_state = (host_dones[-1].clone(), *map(torch.from_numpy, (episodes.returns, episodes.lengths)))
            rank_state = (env_states, staging.clone(), *host_state)
            state = dict(q_network=q_network.state_dict(), agent_kwargs=agent_kwargs, optimizer=optimizer.state_dict())
            rt.save_checkpoint(run, iteration, global_step, rank_state, **state)
        if preempted or reached:
            break

    rt.finish_or_exit_preempted(run, global_step, preempted, envs)


if __name__ == "__main__":
    with rt.exit_codes(SCRIPT):
        main()
