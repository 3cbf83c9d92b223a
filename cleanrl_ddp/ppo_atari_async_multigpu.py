"""PPO on Atari (Nature CNN), data-parallel, the emulator overlapped with the network (two env halves).

Docs: docs/ppo_atari_async_multigpu.md. Launch (two nodes, SLURM: the README):

    python cleanrl_ddp/ppo_atari_async_multigpu.py                                    # 1 process
    torchrun --standalone --nproc_per_node=2 cleanrl_ddp/ppo_atari_async_multigpu.py  # 2 processes, one machine

A variant of ppo_atari_multigpu.py (the same algorithm, flags, sizes, seeds and checkpoints): each rank steps its
games as two halves, each an ALE C++ vector env; while one half steps, the policy picks the other half's actions.
"""

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import tyro
from ale_py.vector_env import AtariVectorEnv
from torch.distributions.categorical import Categorical
from torch.nn.parallel import DistributedDataParallel as DDP

from cleanrl_ddp import atari, evals, graphs
from cleanrl_ddp import runtime as rt

SCRIPT = os.path.basename(__file__)[: -len(".py")]


@dataclass
class Args(rt.RunArgs):
    exp_name: str = SCRIPT
    """the name of this experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""

    # Algorithm specific arguments
    env_id: str = "BreakoutNoFrameskip-v4"
    """the Atari game: `BreakoutNoFrameskip-v4`, `ALE/Breakout-v5` or a ROM name (`breakout`)"""
    repeat_action_probability: Optional[float] = None
    """sticky actions; default 0.25 for `ALE/*-v5` ids (Machado et al., 2018), else 0.0"""
    total_timesteps: int = 10000000
    """agent steps of the whole run, over all ranks (x4 for emulator frames)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    local_num_envs: int = 4
    """the number of parallel environments on each rank (two halves: at least 2)"""
    num_steps: int = 128
    """the number of steps each environment runs per rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of minibatches per epoch, on every rank"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """toggle advantage normalisation over the global minibatch"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggle the clipped value loss"""
    ent_coef: float = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """the maximum norm for clipping the averaged gradient"""
    target_kl: Optional[float] = None
    """stop the epochs when the KL averaged over ranks exceeds this"""
    eval_episodes: int = 10
    """whole games (all lives) per evaluation, on rank 0"""
    eval_greedy: bool = False
    """if toggled, evaluation takes the likeliest action (it can stall a game: no FIRE)"""
    precision: Literal["fp32", "bf16"] = "fp32"
    """`bf16`: the network under bfloat16 autocast"""
    channels_last: bool = True
    """conv weights and activations channels-last (NHWC): faster, same math"""
    grad_sync: Literal["ddp", "flat"] = "ddp"
    """how gradients are averaged: DDP, or one flat all-reduce"""
    cudagraphs: bool = True
    """on CUDA, replay the policy steps, GAE and the update as CUDA graphs"""


def make_env(env_id: str, num_envs: int, num_threads: int = 1, repeat_action_probability: float = 0.0):
    """ALE's C++ vector env, DeepMind's preprocessing; a life loss sets `terminated`."""
    return AtariVectorEnv(
        atari.ale_game(env_id),
        num_envs,
        num_threads=num_threads,
        repeat_action_probability=repeat_action_probability,
        noop_max=30,
        frameskip=4,
        maxpool=True,
        img_height=84,
        img_width=84,
        grayscale=True,
        stack_num=4,
        use_fire_reset=True,
        episodic_life=False,  # ALE's episodic_life restarts the whole game at each life loss
        life_loss_info=True,
        reward_clipping=False,
        max_num_frames_per_episode=108000,
        autoreset_mode="SameStep",
    )


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """The Nature-DQN CNN (Mnih et al., 2015), with policy and value heads."""

    def __init__(self, n_actions: int):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def hidden(self, x):
        # uint8 frames in, scaled here: the rollout buffer stays uint8
        channels_last = self.network[0].weight.is_contiguous(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        return self.network(x * (1.0 / 255.0))

    def get_value(self, x):
        return self.critic(self.hidden(x)).float()

    def get_action_and_value(self, x, action=None):
        hidden = self.hidden(x)
        # under bf16 autocast: the softmax, log-probs and losses in float32
        logits = self.actor(hidden).float()
        probs = Categorical(logits=logits, validate_args=False)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden).float()

    def forward(self, x, action):
        # the loss goes through `forward`, so that DDP averages its gradients
        return self.get_action_and_value(x, action)


def eval_action(agent: Agent, obs, greedy: bool, generator, args: Args):
    """The likeliest action, or one sampled with `generator`."""
    logits = agent.actor(agent.hidden(obs)).float()
    if greedy:
        return logits.argmax(dim=1)
    return torch.multinomial(logits.softmax(dim=1), 1, generator=generator).squeeze(1)


def load_agent(ckpt: dict, device) -> Agent:
    agent = Agent(**ckpt["agent_kwargs"]).to(device)
    agent.load_state_dict(ckpt["agent"])
    return agent


# ALGO LOGIC: sizes, GAE, the loss and the gradient all-reduce
@dataclass(frozen=True)
class Sizes(rt.Sizes):
    local_batch_size: int
    local_minibatch_size: int
    minibatch_size: int


def halves(num_envs: int) -> tuple[slice, slice]:
    """The columns of the rollout buffer (the rank's envs) that each half steps."""
    return slice(0, num_envs // 2), slice(num_envs // 2, num_envs)


def derive_sizes(args: Args, world_size: int) -> Sizes:
    """Global and per-rank sizes, or a RunError."""
    rt.require_at_least_1(args, "local_num_envs", "num_steps", "num_minibatches", "update_epochs", "total_timesteps")
    if args.local_num_envs < 2:
        raise rt.RunError(f"--local-num-envs must be at least 2 (two halves of envs), got {args.local_num_envs}")
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
    """GAE: (advantages, returns) of a [num_steps, num_envs] rollout."""
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
    """Normalise row k of `adv` [num_minibatches, local minibatch] by the mean and std of row k on all ranks."""
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
    """The clipped PPO loss of one local minibatch, and its stats; `model` may be DDP."""
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


def main() -> None:
    args = tyro.cli(Args)
    run = rt.start(args, SCRIPT)
    args, ckpt = rt.load_run(run, args, required=("agent", "optimizer", "agent_kwargs"))
    rank, world_size, device = run.rank, run.world_size, run.device
    sizes = derive_sizes(args, world_size)
    start_iteration = ckpt["iteration"] + 1 if ckpt else 1
    global_step = ckpt["global_step"] if ckpt else 0

    # CRUCIAL: the same start weights on all ranks, but disjoint env seeds and random streams per rank
    rt.seed_everything(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    n = args.local_num_envs
    cols = halves(n)
    # one vector env per half (ALE's batch_size < num_envs mixes them)
    half_sizes = [c.stop - c.start for c in cols]
    sticky = atari.sticky_action_probability(args)
    envs = [make_env(args.env_id, k, min(torch.get_num_threads(), k), sticky) for k in half_sizes]
    agent_kwargs = dict(n_actions=int(envs[0].single_action_space.n))  # saved for evaluate.py
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    agent = Agent(**agent_kwargs).to(device, memory_format=memory_format)
    if world_size > 1:
        for tensor in agent.state_dict().values():  # the same start on either --grad-sync
            dist.broadcast(tensor, src=0)
    # the learning rate is a tensor that a captured step reads
    optimizer = graphs.optimizer(optim.Adam, agent.parameters(), args.learning_rate, device, eps=1e-5, fused=True)
    rt.seed_everything(rt.rank_seed(args.seed, rank))
    if ckpt:
        agent.load_state_dict(ckpt["agent"])
        optimizer.load_state_dict(ckpt["optimizer"])
        rt.resume_rng(run, ckpt, args.seed)
    # gradients allocated once, outside graph memory, in their parameters' memory format (for DDP)
    for p in agent.parameters():
        p.grad = torch.zeros_like(p)
    model = DDP(agent) if world_size > 1 and args.grad_sync == "ddp" else agent
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()

    # ALE's envs cannot be saved: a resumed run seeds them past the used seeds
    env_seed0 = args.seed + rank * n + (start_iteration - 1) * sizes.num_envs
    # env i of the rank: seed env_seed0 + i
    resets = [envs[h].reset(seed=env_seed0 + c.start) for h, c in enumerate(cols)]
    prev_lives = [info["lives"] for _, info in resets]
    episodes = rt.Episodes(n)  # whole games (all lives)

    # ALGO Logic: Storage setup, as in ppo_atari_multigpu.py
    stack, height, width = envs[0].single_observation_space.shape
    obs = torch.zeros((args.num_steps, n, height, width, stack), dtype=torch.uint8, device=device)
    actions = torch.zeros((args.num_steps, n), dtype=torch.long, device=device)
    logprobs = torch.zeros((args.num_steps, n), device=device)
    values = torch.zeros((args.num_steps, n), device=device)
    host_rewards = torch.zeros((args.num_steps, n), pin_memory=run.on_cuda)
    host_dones = torch.zeros((args.num_steps + 1, n), pin_memory=run.on_cuda)  # last row: next_done
    staging = [torch.zeros(frames.shape, dtype=torch.uint8, pin_memory=run.on_cuda) for frames, _ in resets]
    next_obs = [graphs.fill(s.to(device), frames, s) for s, (frames, _) in zip(staging, resets, strict=True)]
    rewards = host_rewards.to(device)
    all_dones = host_dones.to(device)
    rewards_np = host_rewards.numpy()
    dones_np = host_dones.numpy()
    steps = torch.arange(args.num_steps, device=device)
    b_obs = obs.reshape(-1, height, width, stack).permute(0, 3, 1, 2)  # NCHW view, NHWC strides
    b_logprobs = logprobs.reshape(-1)
    b_actions = actions.reshape(-1)
    b_values = values.reshape(-1)

    def policy_step(step, h):
        """Half `h`'s policy, written to rollout row `step` (a tensor: one graph for all rows)."""
        # ALGO LOGIC: action logic (`agent`: inference must not go through DDP)
        with torch.no_grad(), autocast:
            action, logprob, _, value = agent.get_action_and_value(next_obs[h])
        values[step, cols[h]] = value.flatten()
        actions[step, cols[h]] = action
        logprobs[step, cols[h]] = logprob

    def advantages_and_returns():
        with torch.no_grad():
            with autocast:  # bootstrap value if not done
                next_value = agent.get_value(torch.cat(next_obs)).reshape(1, -1)
            dones, next_done = all_dones[:-1], all_dones[-1]
            return compute_gae(rewards, values, dones, next_value, next_done, args.gamma, args.gae_lambda)

    def minibatch_backward(mb_inds, mb_advantages, b_returns):
        minibatch = [b[mb_inds] for b in (b_obs, b_actions, b_logprobs, b_returns, b_values)]
        with autocast:
            loss, mb_stats = ppo_loss(model, mb_advantages, *minibatch, args)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        return mb_stats

    def clip_and_step():
        nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()

    # --cudagraphs: as in ppo_atari_multigpu.py, with one graph per half's policy step
    capture = graphs.enabled(args, run)  # on CUDA only: the CPU runs the same functions eagerly
    flat = world_size > 1 and args.grad_sync == "flat"
    policy_steps = [graphs.graphed(partial(policy_step, h=h), capture) for h in (0, 1)]
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

    update = graphs.graphed(update, capture and world_size == 1)
    num_iterations = sizes.num_iterations
    preempted = False
    rt.open_run(run, sizes, ckpt)

    for iteration in range(start_iteration, num_iterations + 1):
        rollout_start = time.perf_counter()
        lr = args.learning_rate * (1.0 - (iteration - 1.0) / num_iterations if args.anneal_lr else 1.0)
        graphs.set_lr(optimizer, lr)

        dones_np[0] = dones_np[-1]
        # half h's step `step` is sent at half-step 2 * step + h and taken in one half-step later
        for i in range(2 * args.num_steps + 1):
            h, step = i % 2, i // 2
            if step < args.num_steps:
                global_step += world_size * half_sizes[h]  # global: all ranks step at once
                obs[step, cols[h]] = next_obs[h].permute(0, 2, 3, 1)  # a copy
                policy_steps[h](steps[step : step + 1])
                # returns at once; the half steps in the emulator's threads
                envs[h].send(actions[step, cols[h]].cpu().numpy())

            if i > 0:  # take in the half sent one half-step ago
                h, step = (i - 1) % 2, (i - 1) // 2
                # TRY NOT TO MODIFY: execute the game and log data.
                frames, reward, terminations, truncations, info = envs[h].recv()
                # a life loss ends the episode for learning; only a game over ends the logged one
                dones_np[step + 1, cols[h]] = terminations | truncations
                rewards_np[step, cols[h]] = atari.clip_reward(reward)
                over = atari.game_over(terminations, truncations, info["lives"], prev_lives[h])
                episodes.step(reward, over, envs=cols[h])
                prev_lives[h] = info["lives"]
                graphs.fill(next_obs[h], frames, staging[h])

        rewards.copy_(host_rewards, non_blocking=True)
        all_dones.copy_(host_dones, non_blocking=True)
        update_start = time.perf_counter()
        advantages, returns = advantages_and_returns()
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)

        # Optimizing the policy and value network (the same all-reduces on every rank)
        loss_sums = {}
        num_updates = 0
        for _epoch in range(args.update_epochs):
            b_inds = torch.randperm(sizes.local_batch_size, device=device).view(-1, sizes.local_minibatch_size)
            # CRUCIAL: each minibatch is normalised with its global minibatch's statistics
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

        # metrics of ALL ranks, by name in one all-reduce (explained variance from global sums)
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
        scalars = {
            "charts/learning_rate": lr,
            "losses/explained_variance": np.nan if var_y == 0 else 1 - var_diff / var_y,
            "charts/updates_per_iteration": num_updates,
            **{k: v for k, v in m.items() if k.startswith("losses/")},
            # rank 0's wall time, with waits for other ranks
            "perf/rollout_seconds": update_start - rollout_start,
            "perf/update_seconds": update_seconds,
        }
        if flat:
            scalars["perf/grad_sync_seconds"] = grad_sync.take()
        rt.log(run, global_step, scalars, m)
        prev_step = global_step - sizes.batch_size  # the periodic flags count global steps
        if rt.steps_crossed(prev_step, global_step, args.sync_check_every):
            rt.check_replicas_in_sync(f"iteration {iteration}", world_size, agent, optimizer)
        reached = evals.evaluate(run, agent, eval_action, make_env, prev_step, global_step, ale=True)

        preempted = rt.preempted(run)  # a SIGTERM/SIGUSR1 on any rank stops every rank here
        last = iteration == num_iterations or preempted or reached
        if last or rt.steps_crossed(prev_step, global_step, args.checkpoint_every):
            state = dict(agent=agent.state_dict(), agent_kwargs=agent_kwargs, optimizer=optimizer.state_dict())
            rt.save_checkpoint(run, iteration, global_step, None, **state)  # no env state
        if preempted or reached:
            break

    rt.finish_or_exit_preempted(run, global_step, preempted, *envs)


if __name__ == "__main__":
    with rt.exit_codes(SCRIPT):
        main()
