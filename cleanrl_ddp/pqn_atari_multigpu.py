"""PQN (Gallici et al., 2024) on Atari, data-parallel with torch.distributed.

Docs: docs/pqn_atari_multigpu.md. Launch it (all ranks run this same file; more ways in the README):

    python cleanrl_ddp/pqn_atari_multigpu.py                                    # 1 process
    torchrun --standalone --nproc_per_node=2 cleanrl_ddp/pqn_atari_multigpu.py  # 2 processes, one machine

CleanRL's `pqn_atari_envpool.py`: Q(lambda), a Nature CNN with LayerNorm, no replay, no target network.
Each rank steps its own `--local-num-envs` games in ALE's C++ vector env and computes their returns;
gradients are averaged across ranks (DDP, or one flat all-reduce with `--grad-sync flat`), then clipped.
Run plumbing: runtime.py.
"""

import os
import re
from dataclasses import dataclass
from typing import Literal, Optional

import ale_py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tyro
from ale_py.vector_env import AtariVectorEnv
from torch.nn.parallel import DistributedDataParallel as DDP

from cleanrl_ddp import runtime as rt

SCRIPT = os.path.basename(__file__)[: -len(".py")]


@dataclass
class Args(rt.RunArgs):
    exp_name: str = SCRIPT
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment; rank r's envs and sampling streams are derived from it"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled and CUDA is available, train on `cuda:{local_rank}`"""

    # Algorithm specific arguments
    env_id: str = "BreakoutNoFrameskip-v4"
    """the Atari game: `BreakoutNoFrameskip-v4`, `ALE/Breakout-v5` or an ALE ROM name such as `breakout`"""
    repeat_action_probability: Optional[float] = None
    """sticky actions; default 0.25 for `ALE/*-v5` ids (Machado et al., 2018), else 0.0 (the v4 protocol)"""
    total_timesteps: int = 10000000
    """agent steps of the whole run, summed over all ranks (x4 for emulator frames)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    local_num_envs: int = 8
    """the number of parallel game environments on each rank"""
    num_steps: int = 128
    """the number of steps each environment runs per rollout"""
    num_minibatches: int = 4
    """the number of minibatches per epoch (the same on every rank)"""
    update_epochs: int = 4
    """the K epochs to update the Q-network"""
    anneal_lr: bool = True
    """toggle learning rate annealing"""
    gamma: float = 0.99
    """the discount factor gamma"""
    start_e: float = 1
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.10
    """the fraction of `total-timesteps` it takes from start-e to end-e"""
    max_grad_norm: float = 10.0
    """the maximum norm for gradient clipping (of the averaged gradient)"""
    q_lambda: float = 0.65
    """the lambda of the Q(lambda) returns"""
    eval_greedy: bool = False
    """if toggled, evaluation is greedy; default epsilon --end-e (greedy can stall a game: no FIRE)"""
    grad_sync: Literal["ddp", "flat"] = "ddp"
    """how gradients are averaged: DistributedDataParallel, or one all-reduce of all gradients flattened"""


def ale_game(env_id: str) -> str:
    """The ALE ROM name for `BreakoutNoFrameskip-v4`, `ALE/Breakout-v5`, `Breakout` or `breakout`."""
    name = re.sub(r"(NoFrameskip|Deterministic)?-v[0-9]+$", "", env_id.removeprefix("ALE/"))
    game = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()  # MsPacman -> ms_pacman
    if game not in ale_py.roms.get_all_rom_ids():
        raise rt.RunError(
            f"unknown --env-id {env_id!r}: not an ALE game; try BreakoutNoFrameskip-v4, ALE/Pong-v5 or "
            f"space_invaders (one of {len(ale_py.roms.get_all_rom_ids())} ROMs in ale_py.roms.get_all_rom_ids())"
        )
    return game


def sticky_action_probability(args: Args) -> float:
    if args.repeat_action_probability is not None:
        return args.repeat_action_probability
    return 0.25 if args.env_id.startswith("ALE/") and args.env_id.endswith("-v5") else 0.0


def make_env(env_id: str, num_envs: int, num_threads: int = 1, repeat_action_probability: float = 0.0):
    """`num_envs` games in ALE's C++ vector env, DeepMind's preprocessing in C++, as ppo_atari_multigpu.py's:
    a life loss sets `terminated` but the game goes on; rewards unclipped; autoreset within the step."""
    return AtariVectorEnv(
        ale_game(env_id),
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
        episodic_life=False,  # ALE 0.12's episodic_life restarts the whole game at each life loss
        life_loss_info=True,
        reward_clipping=False,
        max_num_frames_per_episode=108000,
        autoreset_mode="SameStep",
    )


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


# ALGO LOGIC: initialize agent here:
class QNetwork(nn.Module):
    """The Nature CNN with LayerNorm after each layer (per-sample statistics: nothing to sync across ranks)."""

    def __init__(self, n_actions: int):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)),
            nn.LayerNorm([32, 20, 20]),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.LayerNorm([64, 9, 9]),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.LayerNorm([64, 7, 7]),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(3136, 512)),
            nn.LayerNorm(512),
            nn.ReLU(),
            layer_init(nn.Linear(512, n_actions)),
        )

    def forward(self, x):
        return self.network(x / 255.0)  # uint8 frames in: the rollout buffer stays uint8


# ALGO LOGIC: pure functions (imported by the tests)
def derive_sizes(args: Args, world_size: int) -> dict:
    """Global and per-rank sizes; raises RunError on bad input."""
    for name in ("local_num_envs", "num_steps", "num_minibatches", "update_epochs", "total_timesteps"):
        if getattr(args, name) < 1:
            raise rt.RunError(f"--{name.replace('_', '-')} must be at least 1")
    if not args.exploration_fraction > 0:
        raise rt.RunError(f"--exploration-fraction must be positive, got {args.exploration_fraction}")
    if not 0.0 <= sticky_action_probability(args) <= 1.0:
        raise rt.RunError("--repeat-action-probability must be between 0 and 1")
    local_batch_size = args.local_num_envs * args.num_steps
    if local_batch_size % args.num_minibatches != 0:
        raise rt.RunError(f"the local batch {local_batch_size} does not divide into --num-minibatches")
    batch_size = local_batch_size * world_size
    num_iterations = args.total_timesteps // batch_size
    if num_iterations < 1:
        raise rt.RunError(f"--total-timesteps is smaller than one iteration's global batch {batch_size}")
    return dict(
        world_size=world_size,
        num_envs=args.local_num_envs * world_size,
        local_batch_size=local_batch_size,
        batch_size=batch_size,
        local_minibatch_size=local_batch_size // args.num_minibatches,
        minibatch_size=batch_size // args.num_minibatches,
        num_iterations=num_iterations,
    )


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def q_lambda_returns(rewards, values, dones, next_value, next_done, gamma, q_lambda):
    """Q(lambda) returns of a [num_steps, num_envs] rollout. `values[t]` is max_a Q(obs[t], a); `dones[t]` is 1
    when `obs[t]` starts an episode (CleanRL's convention), `next_done` likewise after the rollout."""
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
    """One step on this rank's minibatch; `model`: `q_network`, DDP-wrapped under --grad-sync ddp.
    Returns (TD loss, mean Q of the taken actions), detached."""
    q_taken = model(obs).gather(1, actions.unsqueeze(1)).squeeze(1)
    loss = F.mse_loss(q_taken, returns)
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    if world_size > 1 and args.grad_sync == "flat":
        all_reduce_gradients_flat(list(q_network.parameters()), world_size)
    # CRUCIAL: clip the AVERAGED gradient, so that every rank clips the same vector
    nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)
    optimizer.step()
    return loss.detach(), q_taken.mean().detach()


def all_reduce_gradients_flat(params, world_size: int) -> None:
    """Average gradients across ranks with one all-reduce of one flat buffer (instead of DDP).

    After cswinter's batched scheme (entity-neural-network/incubator#220), used by CleanRL.
    """
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


def game_over(terminations, truncations, lives, prev_lives):
    """Which envs finished a whole game this step, not just a life: with same-step autoreset a new
    game's `lives` are full again (see ppo_atari_multigpu.py)."""
    return truncations | (terminations & (lives >= prev_lives))


# Evaluation on rank 0, in envs of its own (cleanrl_ddp/evaluate.py uses these three)
def make_eval_envs(args: Args, num_envs: int, video_dir: Optional[str] = None) -> AtariVectorEnv:
    """`make_env`'s games; ALE cannot render, so `evaluate` writes the videos to `video_dir` itself."""
    envs = make_env(args.env_id, num_envs, min(torch.get_num_threads(), num_envs), sticky_action_probability(args))
    envs.video_dir = video_dir
    return envs


def load_agent(ckpt: dict, device) -> QNetwork:
    q_network = QNetwork(**ckpt["agent_kwargs"]).to(device)
    q_network.load_state_dict(ckpt["q_network"])
    return q_network


def evaluate(q_network, eval_envs, args: Args, greedy: bool, seed: int, device, video_name: Optional[str] = None):
    """One whole game per env, epsilon-greedy (0 if `greedy`, else --end-e) from a stream of its own; returns
    (game scores, lengths, video); with `video_name`, env 0's game is recorded (the newest frame of each step)."""
    epsilon, episodes = 0.0 if greedy else args.end_e, eval_envs.num_envs
    rng = np.random.default_rng(seed)
    obs, info = eval_envs.reset(seed=np.arange(seed, seed + episodes, dtype=np.int64))
    prev_lives = info["lives"]
    frames = [obs[0, -1]] if video_name is not None else None
    returns, lengths = np.zeros(episodes), np.zeros(episodes, dtype=np.int64)
    running = np.ones(episodes, dtype=bool)
    while running.any():
        with torch.no_grad():
            q_values = q_network(torch.as_tensor(obs, device=device))
        explore = rng.random(episodes) < epsilon
        actions = np.where(explore, rng.integers(0, q_values.shape[1], episodes), q_values.argmax(1).cpu().numpy())
        obs, reward, terminations, truncations, info = eval_envs.step(actions)
        over = game_over(terminations, truncations, info["lives"], prev_lives)
        prev_lives = info["lives"]
        returns += reward * running
        lengths += running
        if frames is not None and running[0] and not over[0]:  # at a game over, obs is the next game's
            frames.append(obs[0, -1])
        running &= ~over
    # 60 emulator frames per second, 4 per agent step: 15 frames per second is real time
    return returns, lengths, rt.write_video(frames, eval_envs.video_dir, video_name, fps=15) if frames else None


def main() -> None:
    args = tyro.cli(Args)
    run = rt.start(args, SCRIPT, use_cuda=args.cuda and torch.cuda.is_available())
    args, ckpt = rt.resume(run, args, required=("q_network", "optimizer", "agent_kwargs"))
    rank, world_size, device = run.rank, run.world_size, run.device
    ale_game(args.env_id)  # an unknown game: one line
    sizes = derive_sizes(args, world_size)
    start_iteration = ckpt["iteration"] + 1 if ckpt else 1
    global_step = ckpt["global_step"] if ckpt else 0

    # CRUCIAL: every rank starts from the same weights, but steps its own envs with its own seeds and
    # explores from its own stream. Env seeds are global env indices (disjoint across ranks).
    rt.seed_everything(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    n = args.local_num_envs
    # the env's C++ threads get the rank's share of its cores, as torch's threads do (they alternate)
    envs = make_env(args.env_id, n, min(torch.get_num_threads(), n), sticky_action_probability(args))
    n_actions = int(envs.single_action_space.n)
    agent_kwargs = dict(n_actions=n_actions)  # saved for cleanrl_ddp/evaluate.py
    q_network = QNetwork(**agent_kwargs).to(device)
    if world_size > 1:
        for tensor in q_network.state_dict().values():  # the same start under either --grad-sync
            dist.broadcast(tensor, src=0)
    optimizer = optim.RAdam(q_network.parameters(), lr=args.learning_rate, foreach=True)  # CUDA's default, on CPU too
    rt.seed_everything(int(np.random.SeedSequence([args.seed, rank]).generate_state(1)[0]))
    if ckpt:
        q_network.load_state_dict(ckpt["q_network"])
        optimizer.load_state_dict(ckpt["optimizer"])
        rt.resume_rng(run, ckpt, args.seed)  # each rank's own streams
    model = DDP(q_network) if world_size > 1 and args.grad_sync == "ddp" else q_network
    eval_envs = make_eval_envs(args, args.eval_episodes, rt.video_dir(run)) if run.is_main and args.eval_every else None

    # A resumed run seeds its envs past the seeds earlier attempts used (ALE's env state is not checkpointed).
    env_seed0 = args.seed + rank * n + (start_iteration - 1) * sizes["num_envs"]
    frames, info = envs.reset(seed=np.arange(env_seed0, env_seed0 + n))
    prev_lives = info["lives"]
    game_return, game_length = np.zeros(n), np.zeros(n, dtype=np.int64)  # the game in progress (all lives)

    # ALGO Logic: Storage setup: uint8 frames (the network scales them); host buffers page-locked on CUDA
    obs_shape = envs.single_observation_space.shape
    obs = torch.zeros((args.num_steps, n) + obs_shape, dtype=torch.uint8, device=device)
    actions = torch.zeros((args.num_steps, n), dtype=torch.long, device=device)
    values = torch.zeros((args.num_steps, n), device=device)
    host_rewards = torch.zeros((args.num_steps, n), pin_memory=run.pin)
    host_dones = torch.zeros((args.num_steps + 1, n), pin_memory=run.pin)  # last row: next_done
    staging = torch.zeros((n,) + obs_shape, dtype=torch.uint8, pin_memory=run.pin)  # on CPU, next_obs IS staging
    staging.numpy()[:] = frames
    next_obs = staging.to(device, non_blocking=run.pin)
    num_iterations, preempted = sizes["num_iterations"], False
    duration = args.exploration_fraction * args.total_timesteps
    rt.open_run(run, sizes, ckpt)  # check the sizes, claim the run directory, TensorBoard (W&B)

    for iteration in range(start_iteration, num_iterations + 1):
        if args.anneal_lr:  # iterations are global: the same learning rate on every rank
            frac = 1.0 - (iteration - 1.0) / num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        episodes = np.zeros(3)  # whole games ended: sum of scores, sum of lengths, count
        host_dones[0] = host_dones[-1]
        for step in range(args.num_steps):
            global_step += sizes["num_envs"]  # global: all ranks step at once
            obs[step] = next_obs  # a copy: `staging` (next_obs on CPU) is reused below

            # ALGO LOGIC: epsilon from the GLOBAL step; draws from the rank's own stream
            # (the unwrapped network: inference must not go through DDP)
            epsilon = linear_schedule(args.start_e, args.end_e, duration, global_step)
            random_actions = torch.randint(0, n_actions, (n,), device=device)
            with torch.no_grad():
                values[step], max_actions = q_network(next_obs).max(dim=1)
            explore = torch.rand(n, device=device) < epsilon
            actions[step] = action = torch.where(explore, random_actions, max_actions)

            # TRY NOT TO MODIFY: execute the game and log data.
            frames, reward, terminations, truncations, info = envs.step(action.cpu().numpy())
            # A life loss ends the episode for learning (DeepMind's protocol, CleanRL's episodic_life);
            # only a game over ends the logged episode, whose return is the game's score.
            host_dones[step + 1] = torch.from_numpy(terminations | truncations)
            host_rewards[step] = torch.from_numpy(np.sign(reward))  # DeepMind's reward clipping
            game_return += reward
            game_length += 1
            over = game_over(terminations, truncations, info["lives"], prev_lives)
            prev_lives = info["lives"]
            episodes += (game_return[over].sum(), game_length[over].sum(), over.sum())
            game_return[over], game_length[over] = 0, 0
            staging.numpy()[:] = frames  # action.cpu() waited for the last copy from it
            next_obs = staging.to(device, non_blocking=run.pin)

        rewards = host_rewards.to(device, non_blocking=run.pin)
        all_dones = host_dones.to(device, non_blocking=run.pin)
        dones, next_done = all_dones[:-1], all_dones[-1]

        # ALGO LOGIC: Q(lambda) returns of this rank's own envs (the rank that stepped them)
        with torch.no_grad():
            next_value = q_network(next_obs).max(dim=1).values
            returns = q_lambda_returns(rewards, values, dones, next_value, next_done, args.gamma, args.q_lambda)

        # flatten the batch
        b_obs = obs.reshape((-1,) + obs_shape)
        b_actions = actions.reshape(-1)
        b_returns = returns.reshape(-1)

        # Optimizing the Q-network: the same number of minibatches (all-reduces) on every rank
        td_loss, q_values, num_updates = 0.0, 0.0, 0
        for _epoch in range(args.update_epochs):
            b_inds = torch.randperm(sizes["local_batch_size"], device=device).view(args.num_minibatches, -1)
            for mb_inds in b_inds:
                mb = (b_obs[mb_inds], b_actions[mb_inds], b_returns[mb_inds])
                loss, q_mean = update_q_network(model, q_network, optimizer, *mb, args, world_size)
                td_loss, q_values, num_updates = td_loss + loss, q_values + q_mean, num_updates + 1

        # Metrics of ALL ranks, by name in one all-reduce: losses averaged, whole games summed
        n_all = num_updates * world_size
        losses = {"losses/td_loss": td_loss / n_all, "losses/q_values": q_values / n_all}
        m = rt.all_sum(run, losses | dict(ep_return=episodes[0], ep_length=episodes[1], ep_count=episodes[2]))
        scalars = {"charts/learning_rate": optimizer.param_groups[0]["lr"], "charts/epsilon": epsilon}
        scalars |= {k: v for k, v in m.items() if k.startswith("losses/")}
        rt.log(run, global_step, scalars, (m["ep_return"], m["ep_length"], m["ep_count"]))
        if args.sync_check_every and iteration % args.sync_check_every == 0:
            rt.check_replicas_in_sync(f"iteration {iteration}", world_size, q_network, optimizer)

        # Evaluation on rank 0; the stop decision is broadcast, so all ranks stop together.
        reached = False
        if rt.steps_crossed(global_step - sizes["batch_size"], global_step, args.eval_every):
            with rt.off_the_clock(run):
                video = f"eval-step{global_step}" if args.capture_video else None
                seed = args.seed + 10**9 + global_step  # seeds no training env uses
                result = (
                    evaluate(q_network, eval_envs, args, args.eval_greedy, seed, device, video) if run.is_main else None
                )
                reached = rt.log_evaluation(run, result, global_step)

        preempted = rt.preempted(run)  # a SIGTERM/SIGUSR1 on any rank stops every rank here
        last = iteration == num_iterations or preempted or reached
        if last or (args.checkpoint_every and iteration % args.checkpoint_every == 0):
            # no rank_state: ALE's C++ vector env cannot be pickled (a resumed run reseeds its envs, above)
            state = dict(q_network=q_network.state_dict(), agent_kwargs=agent_kwargs, optimizer=optimizer.state_dict())
            rt.save_checkpoint(run, iteration, global_step, None, **state)
        if preempted or reached:
            break

    rt.finish(run, global_step, preempted, envs, eval_envs)


if __name__ == "__main__":
    with rt.exit_codes(SCRIPT):
        main()
