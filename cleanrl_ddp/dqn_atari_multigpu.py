"""DQN for Atari (CleanRL's `dqn_atari.py`), data-parallel.

Docs: docs/dqn_atari_multigpu.md. Launched as cleanrl_ddp/ppo_multigpu.py is. Each rank fills its own replay
buffer; gradients are averaged across ranks; schedules follow the global step.
"""

import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tyro
from ale_py.vector_env import AtariVectorEnv
from torch.nn.parallel import DistributedDataParallel as DDP

from cleanrl_ddp import atari, checkpoint, evals, graphs, replay
from cleanrl_ddp import runtime as rt

SCRIPT = os.path.basename(__file__)[: -len(".py")]
STACK_NUM = 4  # frames per observation (DeepMind's frame stack)
FRAME_SHAPE = (84, 84)  # one grayscale, resized frame


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
    """total env steps (4 frames each), summed over all ranks"""
    learning_rate: float = 1e-4
    """the learning rate of the optimizer"""
    local_num_envs: int = 1
    """the number of parallel environments on each rank"""
    buffer_size: int = 1000000
    """the replay memory size over all ranks (each rank holds its share)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate (1.0 = copy)"""
    target_network_frequency: int = 1000
    """global steps between target-network updates"""
    local_batch_size: int = 32
    """the batch size each rank samples from its own buffer"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.10
    """the fraction of `total-timesteps` over which epsilon decays to end-e"""
    learning_starts: int = 80000
    """global step to start learning"""
    train_frequency: int = 4
    """global steps between gradient updates"""
    eval_epsilon: float = 0.05
    """epsilon of the evaluation policy (Mnih et al. 2015)"""
    eval_greedy: bool = False
    """if toggled, evaluation is greedy (epsilon 0)"""
    log_every: int = 1000
    """global steps between logged (all-reduced) metrics and preemption checks"""
    grad_sync: Literal["ddp", "flat"] = "ddp"
    """how gradients are averaged: DDP, or one flat all-reduce"""
    cudagraphs: bool = True
    """on CUDA, replay the greedy actions as one CUDA graph"""


def make_env(env_id: str, num_envs: int, num_threads: int = 1, repeat_action_probability: float = 0.0):
    """ALE's C++ vector env, CleanRL's preprocessing; the loop clips rewards and handles lost lives."""
    return AtariVectorEnv(
        atari.ale_game(env_id),
        num_envs,
        num_threads=num_threads,
        repeat_action_probability=repeat_action_probability,
        max_num_frames_per_episode=108000,
        noop_max=30,
        frameskip=4,
        maxpool=True,
        use_fire_reset=True,
        img_height=FRAME_SHAPE[0],
        img_width=FRAME_SHAPE[1],
        grayscale=True,
        stack_num=STACK_NUM,
        episodic_life=False,
        life_loss_info=False,
        reward_clipping=False,
        autoreset_mode="NextStep",
    )


# ALGO LOGIC: initialize agent here:
class QNetwork(nn.Module):
    """CleanRL's Nature-DQN CNN (Mnih et al. 2015), PyTorch's default init."""

    def __init__(self, n_actions: int):
        super().__init__()
        self.network = nn.Sequential(
            nn.Conv2d(STACK_NUM, 32, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(3136, 512),
            nn.ReLU(),
            nn.Linear(512, n_actions),
        )

    def forward(self, x):
        return self.network(x / 255.0)


def eval_action(q_network: QNetwork, obs, greedy: bool, generator, args: Args):
    """Evaluation's actions (cleanrl_ddp/evals.py): epsilon-greedy with --eval-epsilon (or 0)."""
    q_values = q_network(obs)
    epsilon = 0.0 if greedy else args.eval_epsilon
    explore = torch.rand(len(obs), generator=generator, device=obs.device) < epsilon
    random = torch.randint(q_values.shape[1], (len(obs),), generator=generator, device=obs.device)
    return torch.where(explore, random, q_values.argmax(dim=1))


def load_agent(ckpt: dict, device) -> QNetwork:
    q_network = QNetwork(**ckpt["agent_kwargs"]).to(device)
    q_network.load_state_dict(ckpt["q_network"])
    return q_network


# ALGO LOGIC: sizes, schedules, the loss, the update and the gradient all-reduce
@dataclass(frozen=True)
class Sizes(rt.Sizes):
    local_buffer_size: int
    env_buffer_capacity: int
    replay_ratio: float


def derive_sizes(args: Args, world_size: int) -> Sizes:
    """Global and per-rank sizes; raises RunError on bad input."""
    names = ("local_num_envs", "local_batch_size", "total_timesteps", "buffer_size", "train_frequency")
    rt.require_at_least_1(args, *names, "target_network_frequency", "log_every")
    num_envs = args.local_num_envs * world_size
    env_buffer_capacity = args.buffer_size // num_envs  # rounded down: at most --buffer-size
    if env_buffer_capacity < STACK_NUM + 2:
        raise rt.RunError(
            f"--buffer-size {args.buffer_size} leaves {env_buffer_capacity} slots per env; each env needs at "
            f"least {STACK_NUM + 2} (a frame stack and its next observation)"
        )
    if args.learning_starts < num_envs:
        raise rt.RunError(
            f"--learning-starts must be at least the number of envs ({num_envs}), got {args.learning_starts}"
        )
    num_iterations = args.total_timesteps // num_envs
    if num_iterations < 1:
        raise rt.RunError(f"--total-timesteps {args.total_timesteps} is smaller than one step of all {num_envs} envs")
    return Sizes(
        world_size=world_size,
        num_envs=num_envs,
        batch_size=args.local_batch_size * world_size,
        num_iterations=num_iterations,
        local_buffer_size=env_buffer_capacity * args.local_num_envs,
        env_buffer_capacity=env_buffer_capacity,
        replay_ratio=args.local_batch_size * world_size / args.train_frequency,
    )


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def life_lost(lives: np.ndarray, prev_lives: np.ndarray) -> np.ndarray:
    """CleanRL's EpisodicLifeEnv condition: a life was lost but the game goes on."""
    return (lives < prev_lives) & (lives > 0)


def td_loss(model, target_network, obs, actions, rewards, next_obs, terminated, gamma: float):
    """CleanRL's DQN loss (`model` may be DDP) and the mean Q of the taken actions."""
    with torch.no_grad():
        target_max, _ = target_network(next_obs).max(dim=1)
        td_target = rewards + gamma * target_max * (1 - terminated)
    old_val = model(obs).gather(1, actions.view(-1, 1)).squeeze(1)
    return F.mse_loss(td_target, old_val), old_val.mean().detach()


def update_q_network(data: dict, model, q_network, target_network, optimizer, args: Args, world_size: int):
    """One step on this rank's batch, gradients averaged over ranks."""
    loss, q_mean = td_loss(model, target_network, **data, gamma=args.gamma)
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    if world_size > 1 and args.grad_sync == "flat":
        all_reduce_gradients_flat(list(q_network.parameters()), world_size)
    optimizer.step()
    return loss.detach(), q_mean


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
    required = ("q_network", "target_network", "optimizer", "num_updates", "num_target_updates")
    args, ckpt = rt.load_run(run, args, required=required)
    rank, world_size, device = run.rank, run.world_size, run.device
    sizes = derive_sizes(args, world_size)
    start_iteration = ckpt["iteration"] + 1 if ckpt else 1
    global_step = ckpt["global_step"] if ckpt else 0
    train_start = args.learning_starts + global_step
    if ckpt and run.is_main:
        print(f"  updates restart at global step {train_start} (buffer refill)", flush=True)

    # CRUCIAL: the same start weights on every rank, but each rank's own (disjoint) env seeds and random stream
    rt.seed_everything(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    n = args.local_num_envs
    envs = make_env(args.env_id, n, min(n, torch.get_num_threads()), atari.sticky_action_probability(args))
    n_actions = int(envs.single_action_space.n)
    agent_kwargs = dict(n_actions=n_actions)
    q_network = QNetwork(**agent_kwargs).to(device)
    if world_size > 1:
        for tensor in q_network.state_dict().values():  # the same start on either --grad-sync
            dist.broadcast(tensor, src=0)
    optimizer = checkpoint.refuse_misfit_state(optim.Adam(q_network.parameters(), lr=args.learning_rate))
    target_network = QNetwork(**agent_kwargs).to(device)
    target_network.load_state_dict(q_network.state_dict())
    rt.seed_everything(rt.rank_seed(args.seed, rank))
    if ckpt:
        q_network.load_state_dict(ckpt["q_network"])
        target_network.load_state_dict(ckpt["target_network"])
        optimizer.load_state_dict(ckpt["optimizer"])
        rt.resume_rng(run, ckpt, args.seed)
    model = DDP(q_network) if world_size > 1 and args.grad_sync == "ddp" else q_network

    # ALE's envs cannot be saved: a resumed run takes unused seeds
    obs, infos = envs.reset(seed=args.seed + rank * n + (start_iteration - 1) * sizes.num_envs)
    rb = replay.FrameReplayBuffer(sizes.env_buffer_capacity, n, FRAME_SHAPE, STACK_NUM)
    obs_first = np.ones(n, dtype=bool)  # `obs` came from a reset
    obs_final = np.zeros(n, dtype=bool)  # `obs` is a game's last: the next step resets
    prev_lives = infos["lives"].copy()
    staging = torch.zeros(obs.shape, dtype=torch.uint8, pin_memory=run.on_cuda)
    static_obs = staging.to(device)  # the graph's input (on the CPU, staging itself)

    def greedy_actions():
        with torch.no_grad():  # unwrapped: acting skips DDP
            return q_network(static_obs).argmax(dim=1)

    capture = graphs.enabled(args, run)  # CUDA only; the CPU runs eagerly
    greedy_actions = graphs.graphed(greedy_actions, capture)
    episodes = rt.Episodes(n)  # whole games
    sums = dict(td_loss=0.0, q_values=0.0, updates=0)  # since the last logged step
    num_updates = ckpt["num_updates"] if ckpt else 0
    num_target_updates = ckpt["num_target_updates"] if ckpt else 0
    update_seconds = 0.0  # rank 0's, per log interval
    num_iterations = sizes.num_iterations
    preempted = False
    rt.open_run(run, sizes, ckpt)

    for iteration in range(start_iteration, num_iterations + 1):
        prev_step = global_step
        global_step += sizes.num_envs  # global: all ranks step at once

        # ALGO LOGIC: put action logic here (epsilon from the GLOBAL step: the same on every rank)
        epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, prev_step)
        explore = np.random.random(n) < epsilon
        actions = np.random.randint(0, n_actions, n)
        if not explore.all():
            graphs.fill(static_obs, obs, staging)
            actions = np.where(explore, actions, greedy_actions().cpu().numpy())  # the one wait

        # TRY NOT TO MODIFY: execute the game and log data.
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        lives = infos["lives"]
        game_over = (terminations | truncations) & ~obs_final  # a step from a final obs resets
        # episodic life (Mnih et al. 2015): a lost life ends the episode for learning, not logging
        terminated = (terminations | life_lost(lives, prev_lives)) & ~obs_final
        episodes.step(rewards * ~obs_final, game_over, stepped=~obs_final)

        # TRY NOT TO MODIFY: save data to the replay buffer (only the newest frame of the stack)
        rb.add(obs[:, -1], actions, atari.clip_reward(rewards), terminated, obs_first, obs_final)
        obs_first, obs_final = obs_final, game_over
        prev_lives = lives.copy()
        obs = next_obs

        # ALGO LOGIC: training, on the GLOBAL step's schedule: every rank makes the same all-reduces
        if global_step > train_start:
            update_start = time.perf_counter()
            for _ in range(rt.steps_crossed(prev_step, global_step, args.train_frequency)):
                data = {k: rt.to_device(v, device) for k, v in rb.sample(args.local_batch_size).items()}
                loss, q_mean = update_q_network(data, model, q_network, target_network, optimizer, args, world_size)
                sums["td_loss"] += loss.double()
                sums["q_values"] += q_mean.double()
                sums["updates"] += 1
                num_updates += 1
            if rt.steps_crossed(prev_step, global_step, args.target_network_frequency):
                with torch.no_grad():
                    for target_param, q_param in zip(target_network.parameters(), q_network.parameters(), strict=True):
                        target_param.copy_(args.tau * q_param + (1.0 - args.tau) * target_param)
                num_target_updates += 1
            update_seconds += time.perf_counter() - update_start

        # metrics of ALL ranks, by name in one all-reduce
        last = iteration == num_iterations
        logging = bool(rt.steps_crossed(prev_step, global_step, args.log_every)) or last
        if logging:
            m = rt.all_sum(run, sums | episodes.take())
            sums = dict.fromkeys(sums, 0.0)
            scalars = {"charts/epsilon": epsilon, "charts/updates": num_updates}
            scalars |= {"charts/target_updates": num_target_updates, "perf/update_seconds": update_seconds}
            if m["updates"]:
                scalars |= {f"losses/{k}": m[k] / m["updates"] for k in ("td_loss", "q_values")}
            rt.log(run, global_step, scalars, m)
            update_seconds = 0.0
        if rt.steps_crossed(prev_step, global_step, args.sync_check_every):
            rt.check_replicas_in_sync(f"iteration {iteration}", world_size, q_network, target_network, optimizer)
        reached = evals.evaluate(run, q_network, eval_action, make_env, prev_step, global_step, ale=True)

        preempted = logging and rt.preempted(run)  # the vote, on logged steps only
        if last or preempted or reached or rt.steps_crossed(prev_step, global_step, args.checkpoint_every):
            state = dict(q_network=q_network.state_dict(), target_network=target_network.state_dict())
            state |= dict(agent_kwargs=agent_kwargs, optimizer=optimizer.state_dict())
            state |= dict(num_updates=num_updates, num_target_updates=num_target_updates)
            rt.save_checkpoint(run, iteration, global_step, None, **state)
        if preempted or reached:
            break

    rt.finish_or_exit_preempted(run, global_step, preempted, envs)


if __name__ == "__main__":
    with rt.exit_codes(SCRIPT):
        main()
