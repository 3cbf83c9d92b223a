"""PPO for continuous actions (MuJoCo), data-parallel.

Docs: docs/ppo_continuous_action_multigpu.md. Needs MuJoCo: `pip install -e ".[mujoco]"`. Launched as
cleanrl_ddp/ppo_multigpu.py is. Gradients are averaged across ranks each minibatch; the normalisation
statistics are merged across ranks each iteration.
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
import torch.optim as optim
import tyro
from torch.distributions.normal import Normal
from torch.nn.parallel import DistributedDataParallel as DDP

from cleanrl_ddp import env_state, evals, graphs
from cleanrl_ddp import runtime as rt

SCRIPT = os.path.basename(__file__)[: -len(".py")]


@dataclass
class Args(rt.RunArgs):
    exp_name: str = SCRIPT
    """the name of this experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""

    # Algorithm specific arguments
    env_id: str = "HalfCheetah-v5"
    """the id of a gymnasium env with a Box action space"""
    total_timesteps: int = 1000000
    """total env steps, summed over all ranks"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    local_num_envs: int = 1
    """the number of parallel envs on each rank"""
    num_steps: int = 2048
    """the number of steps per env per rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 32
    """the number of minibatches per epoch, on every rank"""
    update_epochs: int = 10
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """toggle advantage normalisation (over the global minibatch)"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggle the clipped value loss"""
    ent_coef: float = 0.0
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """the maximum norm for gradient clipping (of the averaged gradient)"""
    target_kl: Optional[float] = None
    """stop the epochs when the KL averaged over ranks exceeds this"""
    norm_obs: bool = True
    """toggle observation normalisation (statistics over all ranks)"""
    norm_reward: bool = True
    """toggle reward scaling by the std of the discounted return (over all ranks)"""
    clip_obs: float = 10.0
    """normalised observations are clipped to [-clip_obs, clip_obs]"""
    clip_reward: float = 10.0
    """scaled rewards are clipped to [-clip_reward, clip_reward]"""
    eval_greedy: bool = True
    """if toggled, evaluation acts with the Gaussian's mean, else samples"""
    grad_sync: Literal["ddp", "flat"] = "ddp"
    """how gradients are averaged: DDP, or one flat all-reduce"""
    cudagraphs: bool = True
    """on CUDA, replay the policy step, GAE and each minibatch update as CUDA graphs"""


def make_env(env_id: str, render_mode: Optional[str] = None):
    def thunk():  # no normalisation wrappers: the loop normalises over all ranks
        return gym.make(env_id, render_mode=render_mode)

    return thunk


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim: int, action_dim: int):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, action_dim), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, action_dim))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        action_mean = self.actor_mean(x)
        action_std = self.actor_logstd.expand_as(action_mean).exp()
        # validation reads values: a wait on a GPU
        probs = Normal(action_mean, action_std, validate_args=False)
        if action is None:  # rsample: sample()'s draw without its host check
            action = probs.rsample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)

    def forward(self, x, action):
        # the loss goes through `forward`, so that DDP averages its gradients
        return self.get_action_and_value(x, action)


def eval_action(agent: tuple, obs, greedy: bool, generator, args: Args):
    agent, obs_stats = agent
    action = agent.actor_mean(network_input(obs, obs_stats, args))
    if greedy:
        return action
    noise = torch.randn(action.shape, generator=generator, device=action.device)
    return action + agent.actor_logstd.exp() * noise


def load_agent(ckpt: dict, device) -> tuple:
    agent = Agent(**ckpt["agent_kwargs"]).to(device)
    agent.load_state_dict(ckpt["agent"])
    obs_stats = RunningStats(ckpt["obs_stats"]["mean"].shape, device)
    obs_stats.load_state_dict(ckpt["obs_stats"])
    return agent, obs_stats


# ALGO LOGIC: sizes, GAE, the loss, the all-reduce, the normalisation
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


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """GAE: (advantages, returns) of a [num_steps, num_envs] rollout, with CleanRL's `dones`."""
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            nextnonterminal = 1.0 - next_done
            nextvalues = next_value
        else:
            nextnonterminal = 1.0 - dones[t + 1]
            nextvalues = values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
    return advantages, advantages + values


def normalize_advantages(adv: torch.Tensor, world_size: int) -> torch.Tensor:
    """Normalise row k of `adv` [num_minibatches, local minibatch] over row k of every rank."""
    a = adv.double()
    count = torch.full(a.shape[:-1], a.shape[-1], dtype=a.dtype, device=a.device)  # no host copy
    stats = torch.stack([a.sum(-1), (a * a).sum(-1), count])
    if world_size > 1:
        dist.all_reduce(stats)
    total, total_sq, n = stats.unbind()
    mean = total / n
    std = ((total_sq - n * mean * mean) / (n - 1)).clamp_min(0).sqrt()
    return ((adv - mean.float().unsqueeze(-1)) / (std.float().unsqueeze(-1) + 1e-8)).to(adv.dtype)


def ppo_loss(model, mb_advantages, mb_obs, mb_actions, mb_logprobs, mb_returns, mb_values, args: Args):
    """The PPO loss of one local minibatch and its detached stats; `model` may be DDP."""
    _, newlogprob, entropy, newvalue = model(mb_obs, mb_actions)
    logratio = newlogprob - mb_logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        # calculate approx_kl http://joschu.net/blog/kl-approx.html
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()

    # Policy loss
    pg_loss1 = -mb_advantages * ratio
    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

    # Value loss
    newvalue = newvalue.view(-1)
    if args.clip_vloss:
        v_loss_unclipped = (newvalue - mb_returns) ** 2
        v_clipped = mb_values + torch.clamp(newvalue - mb_values, -args.clip_coef, args.clip_coef)
        v_loss_clipped = (v_clipped - mb_returns) ** 2
        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    else:
        v_loss = 0.5 * ((newvalue - mb_returns) ** 2).mean()

    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
    stats = dict(policy_loss=pg_loss, value_loss=v_loss, entropy=entropy_loss)
    stats.update(old_approx_kl=old_approx_kl, approx_kl=approx_kl, clipfrac=clipfrac)
    return loss, {k: v.detach() for k, v in stats.items()}


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


class RunningStats:
    """Count, mean and M2 (sum of squared deviations) per feature in float64, merged over ALL ranks."""

    def __init__(self, shape=(), device=None):
        self.shape = tuple(shape)
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.mean = torch.zeros(self.shape, dtype=torch.float64, device=device)
        self.m2 = torch.zeros(self.shape, dtype=torch.float64, device=device)

    @property
    def var(self) -> torch.Tensor:
        """The population variance (gymnasium's convention); 1 before any sample."""
        return torch.where(self.count == 0, torch.ones_like(self.m2), self.m2 / self.count)

    def update(self, x: torch.Tensor, world_size: int = 1) -> None:
        """Merge the samples `x` [N, *shape] of every rank (Chan et al., 1979)."""
        d = x.to(device=self.mean.device, dtype=torch.float64).reshape((-1,) + self.shape) - self.mean
        n_local = d.new_full((1,), d.shape[0])  # no host copy
        sums = torch.cat([n_local, d.sum(0).reshape(-1), (d * d).sum(0).reshape(-1)])
        if world_size > 1:
            dist.all_reduce(sums)
        n = sums[0]
        s1, s2 = sums[1:].view(2, *self.shape).unbind(0)
        # no `if n == 0` (a wait on a GPU): the clamps make no samples a no-op
        delta = s1 / n.clamp_min(1)
        batch_m2 = s2 - s1 * s1 / n.clamp_min(1)
        total = self.count + n
        # in place: a CUDA graph reads the addresses it captured
        self.m2.add_(batch_m2 + delta * delta * self.count * n / total.clamp_min(1))
        self.mean.add_(delta * n / total.clamp_min(1))
        self.count.copy_(total)

    def state_dict(self) -> dict:
        return dict(count=self.count.cpu(), mean=self.mean.cpu(), m2=self.m2.cpu())

    def load_state_dict(self, state: dict) -> None:
        for name in ("count", "mean", "m2"):
            getattr(self, name).copy_(state[name])

    def tensors(self) -> list[torch.Tensor]:
        return [self.count, self.mean, self.m2]


def normalize_obs(raw_obs, obs_stats: RunningStats, clip: float) -> torch.Tensor:
    x = torch.as_tensor(raw_obs, dtype=torch.float64, device=obs_stats.mean.device)
    return ((x - obs_stats.mean) / torch.sqrt(obs_stats.var + 1e-8)).clamp(-clip, clip).float()


def network_input(raw_obs, obs_stats: RunningStats, args: Args) -> torch.Tensor:
    if args.norm_obs:
        return normalize_obs(raw_obs, obs_stats, args.clip_obs)
    return torch.as_tensor(raw_obs, dtype=torch.float32, device=obs_stats.mean.device)


def scale_reward(reward, return_stats: RunningStats, clip: float) -> torch.Tensor:
    """gymnasium's NormalizeReward: reward / std of the discounted return, clipped."""
    r = torch.as_tensor(reward, dtype=torch.float64, device=return_stats.mean.device)
    return (r / torch.sqrt(return_stats.var + 1e-8)).clamp(-clip, clip).float()


def main() -> None:
    args = tyro.cli(Args)
    run = rt.start(args, SCRIPT)
    args, ckpt = rt.load_run(run, args, required=("agent", "optimizer", "agent_kwargs", "obs_stats", "return_stats"))
    rank, world_size, device = run.rank, run.world_size, run.device
    rt.check_env(
        args.env_id,
        make_env,
        gym.spaces.Box,
        hint="try HalfCheetah-v5, Hopper-v5 or InvertedPendulum-v5; ppo_multigpu.py for discrete actions",
    )
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
    obs_shape = envs.single_observation_space.shape
    action_shape = envs.single_action_space.shape
    agent_kwargs = dict(obs_dim=int(np.prod(obs_shape)), action_dim=int(np.prod(action_shape)))
    agent = Agent(**agent_kwargs).to(device)
    if world_size > 1:
        for tensor in agent.state_dict().values():  # the same start on either --grad-sync
            dist.broadcast(tensor, src=0)
    # lr as a tensor, read by a captured step
    optimizer = graphs.optimizer(optim.Adam, agent.parameters(), args.learning_rate, device, eps=1e-5, fused=True)
    rt.seed_everything(rt.rank_seed(args.seed, rank))
    obs_stats, return_stats = RunningStats(obs_shape, device), RunningStats((), device)
    if ckpt:
        agent.load_state_dict(ckpt["agent"])
        optimizer.load_state_dict(ckpt["optimizer"])
        obs_stats.load_state_dict(ckpt["obs_stats"])
        return_stats.load_state_dict(ckpt["return_stats"])
        rt.resume_rng(run, ckpt, args.seed)
    # gradients allocated once, outside graph memory: backward adds to them
    for p in agent.parameters():
        p.grad = torch.zeros_like(p)
    model = DDP(agent) if world_size > 1 and args.grad_sync == "ddp" else agent

    n = args.local_num_envs
    env_seed0 = args.seed + rank * n
    next_raw_obs, _ = envs.reset(seed=env_seed0)
    episodes = rt.Episodes(n)
    discounted_return = np.zeros(n)  # per env, for reward scaling
    next_done = np.zeros(n)
    if ckpt:  # every env resumes where it was, whichever rank steps it now
        share = env_state.split_for_rank(run, ckpt)
        if env_state.restore(run, envs.envs, share[0] if share else None):
            next_raw_obs, next_done, episodes.returns, episodes.lengths, discounted_return = (
                x.numpy() for x in share[1:]
            )
        else:  # no state function: new episodes, from unused seeds
            next_raw_obs, _ = envs.reset(seed=env_seed0 + (start_iteration - 1) * sizes.num_envs)

    # ALGO Logic: Storage setup, allocated once (a CUDA graph replays the addresses)
    obs = torch.zeros((args.num_steps, n) + obs_shape, device=device)  # normalised, as acted on
    actions = torch.zeros((args.num_steps, n) + action_shape, device=device)
    logprobs = torch.zeros((args.num_steps, n), device=device)
    values = torch.zeros((args.num_steps, n), device=device)
    raw_obs = torch.zeros((args.num_steps, n) + obs_shape, dtype=torch.float64, device=device)
    host_returns = torch.zeros((args.num_steps, n), dtype=torch.float64, pin_memory=run.on_cuda)
    host_rewards = torch.zeros((args.num_steps, n), dtype=torch.float64, pin_memory=run.on_cuda)
    host_dones = torch.zeros((args.num_steps + 1, n), pin_memory=run.on_cuda)  # last row: next_done
    host_dones[-1] = torch.from_numpy(next_done)
    staging = torch.zeros((n,) + obs_shape, dtype=torch.float64, pin_memory=run.on_cuda)
    next_raw = staging.to(device)
    rewards = host_rewards.to(device)
    all_dones = host_dones.to(device)
    raw_returns = host_returns.to(device)
    graphs.fill(next_raw, next_raw_obs, staging)
    action_low, action_high = envs.single_action_space.low, envs.single_action_space.high
    steps = torch.arange(args.num_steps, device=device)
    b_obs = obs.reshape((-1,) + obs_shape)  # the flattened batch: views of the rollout buffers
    b_actions = actions.reshape((-1,) + action_shape)
    b_logprobs = logprobs.reshape(-1)
    b_values = values.reshape(-1)

    def policy_step(step):
        """The policy on `next_raw` into row `step` (a tensor: one graph for every row)."""
        next_obs = network_input(next_raw, obs_stats, args)
        # ALGO LOGIC: action logic (the unwrapped agent: inference skips DDP)
        with torch.no_grad():
            action, logprob, _, value = agent.get_action_and_value(next_obs)
        obs[step] = next_obs
        values[step] = value.flatten()
        actions[step] = action
        logprobs[step] = logprob

    def advantages_and_returns():
        scaled = scale_reward(rewards, return_stats, args.clip_reward) if args.norm_reward else rewards.float()
        with torch.no_grad():  # bootstrap value if not done
            next_value = agent.get_value(network_input(next_raw, obs_stats, args)).reshape(1, -1)
            dones, next_done = all_dones[:-1], all_dones[-1]
            return compute_gae(scaled, values, dones, next_value, next_done, args.gamma, args.gae_lambda)

    def minibatch_backward(mb_inds, mb_advantages, b_returns):
        minibatch = [b[mb_inds] for b in (b_obs, b_actions, b_logprobs, b_returns, b_values)]
        loss, mb_stats = ppo_loss(model, mb_advantages, *minibatch, args)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        return mb_stats

    def clip_and_step():
        nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()

    # no collective inside a graph: across ranks the backward and the step are graphed apart, around the
    # flat all-reduce; under DDP (which all-reduces in the backward) the backward stays eager
    capture = graphs.enabled(args, run)  # on CUDA only
    flat = world_size > 1 and args.grad_sync == "flat"
    policy_step = graphs.graphed(policy_step, capture)
    advantages_and_returns = graphs.graphed(advantages_and_returns, capture)
    minibatch_backward = graphs.graphed(minibatch_backward, capture and flat)
    clip_and_step = graphs.graphed(clip_and_step, capture and world_size > 1)
    grad_sync = rt.Stopwatch()

    def update(mb_inds, mb_advantages, b_returns):
        mb_stats = minibatch_backward(mb_inds, mb_advantages, b_returns)
        if flat:
            with grad_sync:
                all_reduce_gradients_flat(agent.parameters(), world_size)
        clip_and_step()
        return mb_stats

    # at world size 1 the whole update is one graph
    update = graphs.graphed(update, capture and world_size == 1)
    num_iterations = sizes.num_iterations
    preempted = False
    rt.open_run(run, sizes, ckpt)

    for iteration in range(start_iteration, num_iterations + 1):
        rollout_start = time.perf_counter()
        lr = args.learning_rate * (1.0 - (iteration - 1.0) / num_iterations if args.anneal_lr else 1.0)
        graphs.set_lr(optimizer, lr)

        host_dones[0] = host_dones[-1]
        for step in range(args.num_steps):
            global_step += sizes.num_envs  # global: all ranks step at once
            raw_obs[step] = next_raw  # a copy: `next_raw` is refilled below
            policy_step(steps[step : step + 1])

            # TRY NOT TO MODIFY: execute the game and log data.
            # the env gets the action clipped to its bounds, the buffer the sampled one
            next_raw_obs, reward, terminations, truncations, _ = envs.step(
                np.clip(actions[step].cpu().numpy(), action_low, action_high)
            )
            next_done = np.logical_or(terminations, truncations)
            episodes.step(reward, next_done)
            discounted_return = discounted_return * args.gamma + reward
            host_returns[step] = torch.from_numpy(discounted_return)
            discounted_return[next_done] = 0
            host_rewards[step] = torch.from_numpy(reward)
            host_dones[step + 1] = torch.from_numpy(next_done)
            graphs.fill(next_raw, next_raw_obs, staging)

        rewards.copy_(host_rewards, non_blocking=True)
        all_dones.copy_(host_dones, non_blocking=True)
        raw_returns.copy_(host_returns, non_blocking=True)
        update_start = time.perf_counter()
        advantages, returns = advantages_and_returns()
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)

        # CRUCIAL: the statistics change only here, after the bootstrap value (normalised as the rollout was),
        # from the samples of all ranks, so all ranks normalise alike
        if args.norm_obs:
            obs_stats.update(raw_obs, world_size)
        if args.norm_reward:
            return_stats.update(raw_returns, world_size)

        # Optimizing the policy and value network (the same all-reduces on every rank)
        loss_sums = {}
        num_updates = 0
        for _epoch in range(args.update_epochs):
            b_inds = torch.randperm(sizes.local_batch_size, device=device).view(-1, sizes.local_minibatch_size)
            # CRUCIAL: minibatch k (row k) is normalised with the statistics of global minibatch k
            epoch_advantages = b_advantages[b_inds]
            if args.norm_adv:
                epoch_advantages = normalize_advantages(epoch_advantages, world_size)
            for mb_inds, mb_advantages in zip(b_inds, epoch_advantages, strict=True):
                mb_stats = update(mb_inds, mb_advantages, b_returns)
                loss_sums = {k: loss_sums.get(k, 0) + v for k, v in mb_stats.items()}
                num_updates += 1

            if args.target_kl is not None:
                # CRUCIAL: decide from the KL averaged over ranks, so every rank stops after the same epoch
                kl = mb_stats["approx_kl"].clone()
                if world_size > 1:
                    dist.all_reduce(kl)
                if kl.item() / world_size > args.target_kl:
                    break
        update_seconds = time.perf_counter() - update_start

        # metrics of ALL ranks in one all-reduce (explained variance from global sums)
        y, d = b_returns, b_returns - b_values
        m = rt.all_sum(
            run,
            {f"losses/{k}": v / num_updates / world_size for k, v in loss_sums.items()}
            | dict(y=y.sum(), y2=(y * y).sum(), d=d.sum(), d2=(d * d).sum())
            | episodes.take(),
        )
        n_batch = sizes.batch_size
        var_y = m["y2"] / n_batch - (m["y"] / n_batch) ** 2
        var_diff = m["d2"] / n_batch - (m["d"] / n_batch) ** 2
        # equal on every rank: one read
        norm = dict(count=obs_stats.count, obs_std_mean=obs_stats.var.sqrt().mean(), return_std=return_stats.var.sqrt())
        norm = dict(zip(norm, torch.stack(list(norm.values())).tolist(), strict=True))
        scalars = {
            "charts/learning_rate": lr,
            "losses/explained_variance": np.nan if var_y == 0 else 1 - var_diff / var_y,
            "charts/updates_per_iteration": num_updates,
            **{k: v for k, v in m.items() if k.startswith("losses/")},
            # rank 0's wall time, waits for other ranks included
            "perf/rollout_seconds": update_start - rollout_start,
            "perf/update_seconds": update_seconds,
            **{f"norm/{k}": v for k, v in norm.items()},
        }
        if flat:
            scalars["perf/grad_sync_seconds"] = grad_sync.take()
        rt.log(run, global_step, scalars, m)
        prev_step = global_step - sizes.batch_size  # the periodic flags count global steps
        if rt.steps_crossed(prev_step, global_step, args.sync_check_every):
            stats = [*obs_stats.tensors(), *return_stats.tensors()]
            rt.check_replicas_in_sync(f"iteration {iteration}", world_size, agent, optimizer, *stats)
        reached = evals.evaluate(run, (agent, obs_stats), eval_action, make_env, prev_step, global_step)

        preempted = rt.preempted(run)  # a SIGTERM/SIGUSR1 on any rank stops every rank here
        last = iteration == num_iterations or preempted or reached
        if last or rt.steps_crossed(prev_step, global_step, args.checkpoint_every):
            # this rank's envs as data, not pickled
            env_states = [env_state.capture(env) for env in envs.envs]
            arrays = (next_raw_obs, host_dones[-1].numpy().copy(), episodes.returns, episodes.lengths)
            rank_state = (env_states, *map(torch.from_numpy, (*arrays, discounted_return)))
            state = dict(agent=agent.state_dict(), agent_kwargs=agent_kwargs, optimizer=optimizer.state_dict())
            state |= dict(obs_stats=obs_stats.state_dict(), return_stats=return_stats.state_dict())
            rt.save_checkpoint(run, iteration, global_step, rank_state, **state)
        if preempted or reached:
            break

    rt.finish_or_exit_preempted(run, global_step, preempted, envs)


if __name__ == "__main__":
    with rt.exit_codes(SCRIPT):
        main()
