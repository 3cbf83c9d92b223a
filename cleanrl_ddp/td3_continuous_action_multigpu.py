"""TD3 for continuous actions (CleanRL's `td3_continuous_action.py`), data-parallel.

Docs: docs/td3_continuous_action_multigpu.md. Needs MuJoCo: `pip install -e ".[mujoco]"`. Launched as
cleanrl_ddp/ppo_multigpu.py is. Each rank fills its own replay buffer; gradients are averaged across ranks;
schedules follow the global step.
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

from cleanrl_ddp import evals, graphs, replay
from cleanrl_ddp import runtime as rt

SCRIPT = os.path.basename(__file__)[: -len(".py")]


@dataclass
class Args(rt.RunArgs):
    exp_name: str = SCRIPT
    """the name of this experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""

    # Algorithm specific arguments
    env_id: str = "Hopper-v5"
    """the id of a gymnasium environment with a Box action space"""
    total_timesteps: int = 1000000
    """total env steps, summed over all ranks"""
    learning_rate: float = 3e-4
    """the learning rate of the actor and critic optimizers"""
    local_num_envs: int = 1
    """the number of parallel environments on each rank"""
    buffer_size: int = 1000000
    """the replay memory size over all ranks (each rank holds its share)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient"""
    local_batch_size: int = 256
    """the batch size each rank samples from its own buffer"""
    updates_per_iteration: int = 1
    """updates per step of all envs of all ranks (1: CleanRL's replay ratio)"""
    policy_noise: float = 0.2
    """the scale of the target policy smoothing noise (x action scale)"""
    exploration_noise: float = 0.1
    """the scale of the Gaussian exploration noise (x action scale)"""
    learning_starts: int = 25000
    """global step to start learning (random actions before)"""
    policy_frequency: int = 2
    """critic updates between actor and target-network updates (delayed)"""
    noise_clip: float = 0.5
    """the clip of the target policy smoothing noise (x action scale)"""
    eval_greedy: bool = True
    """if toggled, evaluation acts without exploration noise, else with it"""
    log_every: int = 1000
    """global steps between logged (all-reduced) metrics and preemption checks"""
    grad_sync: Literal["ddp", "flat"] = "ddp"
    """how gradients are averaged: DDP, or one flat all-reduce"""
    compile: bool = False
    """`torch.compile` the losses and their backward (docs/gpu.md)"""
    cudagraphs: bool = True
    """on CUDA, replay the action choice and each update as CUDA graphs"""


def make_env(env_id: str, render_mode: Optional[str] = None):
    def thunk():
        return gym.make(env_id, render_mode=render_mode)

    return thunk


# ALGO LOGIC: initialize agent here:
class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, action_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(obs_dim + action_dim, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc3 = nn.Linear(256, 1)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class TwinQ(nn.Module):
    """CleanRL's qf1 and qf2 as one module: one optimizer, one DDP, one all-reduce."""

    def __init__(self, obs_dim: int, action_dim: int):
        super().__init__()
        self.qf1, self.qf2 = QNetwork(obs_dim, action_dim), QNetwork(obs_dim, action_dim)

    def forward(self, x, a):
        return self.qf1(x, a).view(-1), self.qf2(x, a).view(-1)


class Actor(nn.Module):
    def __init__(self, obs_dim: int, action_dim: int, action_low: list, action_high: list):
        super().__init__()
        self.fc1 = nn.Linear(obs_dim, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc_mu = nn.Linear(256, action_dim)
        # action rescaling
        low = torch.tensor(action_low, dtype=torch.float32)
        high = torch.tensor(action_high, dtype=torch.float32)
        self.register_buffer("action_scale", (high - low) / 2.0)
        self.register_buffer("action_bias", (high + low) / 2.0)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = torch.tanh(self.fc_mu(x))
        return x * self.action_scale + self.action_bias


def eval_action(actor: Actor, obs, greedy: bool, generator, args: Args):
    """Evaluation's actions (cleanrl_ddp/evals.py): the actor's, plus exploration noise unless `greedy`."""
    action = actor(obs.float())
    if not greedy:
        noise = torch.randn(action.shape, generator=generator, device=action.device)
        action += noise * actor.action_scale * args.exploration_noise
    return action


def load_agent(ckpt: dict, device) -> Actor:
    actor = Actor(**ckpt["agent_kwargs"]).to(device)
    actor.load_state_dict(ckpt["actor"])
    return actor


# ALGO LOGIC: sizes, losses, updates and the gradient all-reduce
@dataclass(frozen=True)
class Sizes(rt.Sizes):
    local_buffer_size: int
    updates_per_env_step: float
    replay_ratio: float


def derive_sizes(args: Args, world_size: int) -> Sizes:
    """Global and per-rank sizes; raises RunError on bad input."""
    names = ("local_num_envs", "local_batch_size", "total_timesteps", "buffer_size", "updates_per_iteration")
    rt.require_at_least_1(args, *names, "policy_frequency", "log_every")
    num_envs = args.local_num_envs * world_size
    if args.buffer_size // world_size < 2 * args.local_num_envs:
        raise rt.RunError(
            f"--buffer-size {args.buffer_size} leaves {args.buffer_size // world_size} transitions to each of "
            f"{world_size} ranks; each needs two steps of its --local-num-envs {args.local_num_envs} envs"
        )
    num_iterations = args.total_timesteps // num_envs
    if num_iterations < 1:
        raise rt.RunError(f"--total-timesteps {args.total_timesteps} is smaller than one step of all {num_envs} envs")
    return Sizes(
        world_size=world_size,
        num_envs=num_envs,
        batch_size=args.local_batch_size * world_size,
        num_iterations=num_iterations,
        local_buffer_size=args.buffer_size // world_size,  # rounded down: at most --buffer-size
        updates_per_env_step=args.updates_per_iteration / num_envs,
        replay_ratio=args.updates_per_iteration * args.local_batch_size * world_size / num_envs,
    )


def critic_loss(qf_model, qf_target, target_actor, obs, actions, rewards, next_obs, terminations, args: Args):
    """The twin Q values and losses of this rank's batch; the smoothing noise from this rank's stream."""
    with torch.no_grad():
        noise = torch.randn(actions.shape, device=actions.device) * args.policy_noise
        clipped_noise = noise.clamp(-args.noise_clip, args.noise_clip) * target_actor.action_scale
        low = target_actor.action_bias - target_actor.action_scale
        high = target_actor.action_bias + target_actor.action_scale
        next_state_actions = (target_actor(next_obs) + clipped_noise).clamp(low, high)
        qf1_next_target, qf2_next_target = qf_target(next_obs, next_state_actions)
        min_qf_next_target = torch.min(qf1_next_target, qf2_next_target)
        next_q_value = rewards + (1 - terminations) * args.gamma * min_qf_next_target
    qf1_a_values, qf2_a_values = qf_model(obs, actions)
    qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
    qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
    return qf1_a_values, qf2_a_values, qf1_loss, qf2_loss


def policy_loss(actor_model, qf, obs):
    """The actor's loss, through the first critic (`qf` unwrapped, frozen)."""
    qf1_pi = qf.qf1(obs, actor_model(obs))
    return -qf1_pi.mean()


@torch.no_grad()
def soft_update(nets, targets, tau: float) -> None:
    """Polyak-average `targets` towards `nets`, in one lerp."""
    online = [p for net in nets for p in net.parameters()]
    torch._foreach_lerp_([p for target in targets for p in target.parameters()], online, tau)


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
    required = ("actor", "target_actor", "qf", "qf_target", "actor_optimizer", "q_optimizer")
    required += ("agent_kwargs", "num_updates", "num_actor_updates")
    args, ckpt = rt.load_run(run, args, required=required)
    rank, world_size, device = run.rank, run.world_size, run.device
    rt.check_env(args.env_id, make_env, gym.spaces.Box, hint="try Hopper-v5, HalfCheetah-v5 or Pendulum-v1")
    sizes = derive_sizes(args, world_size)
    capture = graphs.enabled(args, run)  # CUDA only; the CPU runs eagerly
    start_iteration = ckpt["iteration"] + 1 if ckpt else 1
    global_step = ckpt["global_step"] if ckpt else 0

    # CRUCIAL: the same start weights on every rank, but each rank's own (disjoint) env seeds and random stream
    rt.seed_everything(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    n = args.local_num_envs
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id) for _ in range(n)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    action_dim = int(np.prod(envs.single_action_space.shape))
    action_low, action_high = envs.single_action_space.low, envs.single_action_space.high
    # plain lists: checkpoints hold data only
    agent_kwargs = dict(obs_dim=obs_dim, action_dim=action_dim, action_low=action_low.tolist())
    agent_kwargs["action_high"] = action_high.tolist()
    actor = Actor(**agent_kwargs).to(device)
    qf = TwinQ(obs_dim, action_dim).to(device)
    if world_size > 1:  # the same start on either --grad-sync
        for tensor in [*actor.state_dict().values(), *qf.state_dict().values()]:
            dist.broadcast(tensor, src=0)
    target_actor = Actor(**agent_kwargs).to(device)
    qf_target = TwinQ(obs_dim, action_dim).to(device)
    target_actor.load_state_dict(actor.state_dict())
    qf_target.load_state_dict(qf.state_dict())
    # fused: one kernel per step; tensor learning rates for captured steps
    q_optimizer = graphs.optimizer(optim.Adam, qf.parameters(), args.learning_rate, device, fused=True)
    actor_optimizer = graphs.optimizer(optim.Adam, actor.parameters(), args.learning_rate, device, fused=True)
    rt.seed_everything(rt.rank_seed(args.seed, rank))
    # everything learned, by checkpoint key: identical on every rank
    learned = dict(actor=actor, target_actor=target_actor, qf=qf, qf_target=qf_target)
    learned |= dict(actor_optimizer=actor_optimizer, q_optimizer=q_optimizer)
    num_updates = ckpt["num_updates"] if ckpt else 0
    num_actor_updates = ckpt["num_actor_updates"] if ckpt else 0
    if ckpt:
        for key, obj in learned.items():
            obj.load_state_dict(ckpt[key])
        rt.resume_rng(run, ckpt, args.seed)
    # gradients allocated once, outside graph memory: backward adds to them
    for p in [*qf.parameters(), *actor.parameters()]:
        p.grad = torch.zeros_like(p)
    ddp = world_size > 1 and args.grad_sync == "ddp"
    # the actor's buffers are equal constants: no broadcast per forward
    actor_model = DDP(actor, broadcast_buffers=False) if ddp else actor
    qf_model = DDP(qf) if ddp else qf
    # --compile: the losses and their backward (its own graphs only without --cudagraphs)
    compile_mode = "reduce-overhead" if run.on_cuda and not capture else None
    critic_loss_fn, policy_loss_fn = (
        torch.compile(f, mode=compile_mode) if args.compile else f for f in (critic_loss, policy_loss)
    )
    flat = world_size > 1 and args.grad_sync == "flat"

    def critic_backward(data):
        qf1_a_values, qf2_a_values, qf1_loss, qf2_loss = critic_loss_fn(
            qf_model, qf_target, target_actor, **data, args=args
        )
        q_optimizer.zero_grad(set_to_none=False)
        (qf1_loss + qf2_loss).backward()
        return torch.stack((qf1_a_values.mean(), qf2_a_values.mean(), qf1_loss, qf2_loss)).detach()

    def critic_step():
        q_optimizer.step()

    def actor_backward(obs):
        # CRUCIAL: critics unwrapped and frozen: no critic all-reduce (as on the flat path), no critic gradients
        qf.requires_grad_(False)
        actor_loss = policy_loss_fn(actor_model, qf, obs)
        qf.requires_grad_(True)
        actor_optimizer.zero_grad(set_to_none=False)
        actor_loss.backward()
        return actor_loss.detach()

    def actor_step_and_targets():
        actor_optimizer.step()
        soft_update([actor, qf], [target_actor, qf_target], args.tau)

    # --cudagraphs: no all-reduce inside a graph: across ranks, backward and step are graphed apart
    # (DDP's backward, which all-reduces, not at all)
    # explore with evaluation's noisy action; unwrapped: acting skips DDP
    act = graphs.graphed(lambda obs: eval_action(actor, obs, False, None, args), capture)
    critic_backward = graphs.graphed(critic_backward, capture and flat)
    actor_backward = graphs.graphed(actor_backward, capture and flat)
    critic_step = graphs.graphed(critic_step, capture and world_size > 1)
    actor_step_and_targets = graphs.graphed(actor_step_and_targets, capture and world_size > 1)

    def update_critics(data):
        critic_stats = critic_backward(data)
        if flat:
            all_reduce_gradients_flat(qf.parameters(), world_size)
        critic_step()
        return critic_stats

    def update_actor(obs):  # then the target networks
        actor_loss = actor_backward(obs)
        if flat:
            all_reduce_gradients_flat(actor.parameters(), world_size)
        actor_step_and_targets()
        return actor_loss

    # at world size 1 each update is one graph
    update_critics = graphs.graphed(update_critics, capture and world_size == 1)
    update_actor = graphs.graphed(update_actor, capture and world_size == 1)

    # this rank's own replay buffer, on the device, sampled with its own generator
    sample_seed = rt.rank_seed(args.seed, rank, start_iteration)
    rb = replay.ReplayBuffer(sizes.local_buffer_size, obs_dim, action_dim, device, sample_seed)
    episodes = rt.Episodes(n)
    obs, _ = envs.reset(seed=args.seed + rank * n + (start_iteration - 1) * sizes.num_envs)
    # a resume continues each rank's envs and buffer; at another world size: the unused seeds above, and a refill
    obs = replay.resume(run, ckpt, rb, envs, episodes, obs) if ckpt else obs
    train_start = args.learning_starts + (global_step if ckpt and rb.size == 0 else 0)
    if ckpt and rb.size == 0 and run.is_main:
        print(f"  updates restart at global step {train_start} (buffer refill)", flush=True)
    # this rank's sums since the last log: update counts, and the losses in one tensor on the device
    loss_names = ("qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "actor_loss")
    counts = dict(updates=0, actor_updates=0)
    loss_sums = torch.zeros(len(loss_names), dtype=torch.float64, device=device)
    update_seconds = 0.0  # rank 0's, per log interval
    num_iterations = sizes.num_iterations
    preempted = False
    rt.open_run(run, sizes, ckpt)

    for iteration in range(start_iteration, num_iterations + 1):
        prev_step = global_step
        global_step += sizes.num_envs  # global: all ranks step at once

        # ALGO LOGIC: put action logic here (random until the GLOBAL step reaches learning_starts)
        if prev_step < args.learning_starts:
            actions = np.random.uniform(action_low, action_high, (n, action_dim)).astype(np.float32)
        else:
            with torch.no_grad():  # the noise from this rank's stream
                actions = act(rt.to_device(obs, device, dtype=torch.float32))
            # the one wait for the device per env step
            actions = actions.cpu().numpy().clip(action_low, action_high)

        # TRY NOT TO MODIFY: execute the game and log data.
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        done = terminations | truncations
        episodes.step(rewards, done)

        # TRY NOT TO MODIFY: save data to the replay buffer; handle `final_obs`
        real_next_obs = next_obs.copy()
        if done.any():  # SAME_STEP autoreset: next_obs is the reset one
            real_next_obs[done] = np.stack(infos["final_obs"][done])
        rb.add(obs, real_next_obs, actions, rewards, terminations)
        obs = next_obs

        # ALGO LOGIC: training, on the GLOBAL step's schedule: every rank makes the same all-reduces
        if global_step > train_start:
            update_start = time.perf_counter()
            for _ in range(args.updates_per_iteration):
                data = rb.sample(args.local_batch_size)
                critic_stats = update_critics(data)
                num_updates += 1
                counts["updates"] += 1
                loss_sums[:4] += critic_stats

                if num_updates % args.policy_frequency == 0:  # TD3's delayed update, then the targets
                    actor_loss = update_actor(data["obs"])
                    num_actor_updates += 1
                    counts["actor_updates"] += 1
                    loss_sums[4] += actor_loss
            update_seconds += time.perf_counter() - update_start

        # metrics of ALL ranks, by name in one all-reduce
        last = iteration == num_iterations
        logging = bool(rt.steps_crossed(prev_step, global_step, args.log_every)) or last
        if logging:
            m = rt.all_sum(run, counts | dict(zip(loss_names, loss_sums, strict=True)) | episodes.take())
            counts = dict.fromkeys(counts, 0)
            loss_sums.zero_()
            scalars = {"charts/updates": num_updates, "charts/actor_updates": num_actor_updates}
            scalars["perf/update_seconds"] = update_seconds
            if m["updates"]:
                scalars |= {f"losses/{k}": m[k] / m["updates"] for k in loss_names[:4]}
                scalars["losses/qf_loss"] = (m["qf1_loss"] + m["qf2_loss"]) / m["updates"] / 2.0
            if m["actor_updates"]:
                scalars["losses/actor_loss"] = m["actor_loss"] / m["actor_updates"]
            rt.log(run, global_step, scalars, m)
            update_seconds = 0.0
        if rt.steps_crossed(prev_step, global_step, args.sync_check_every):
            rt.check_replicas_in_sync(f"iteration {iteration}", world_size, *learned.values())
        reached = evals.evaluate(run, actor, eval_action, make_env, prev_step, global_step)

        preempted = logging and rt.preempted(run)  # the vote, on logged steps only
        if last or preempted or reached or rt.steps_crossed(prev_step, global_step, args.checkpoint_every):
            state = {key: obj.state_dict() for key, obj in learned.items()}
            state |= dict(agent_kwargs=agent_kwargs, num_updates=num_updates, num_actor_updates=num_actor_updates)
            rt.save_checkpoint(run, iteration, global_step, replay.rank_state(rb, envs, obs, episodes), **state)
        if preempted or reached:
            break

    rt.finish_or_exit_preempted(run, global_step, preempted, envs)


if __name__ == "__main__":
    with rt.exit_codes(SCRIPT):
        main()
