"""DQN for Atari (CleanRL's `dqn_atari.py`), data-parallel with torch.distributed.

Docs: docs/dqn_atari_multigpu.md. Launch it any of these ways (all ranks run this same file):

    # 1 process (no process group)
    python cleanrl_ddp/dqn_atari_multigpu.py
    # 2 processes on one machine
    torchrun --standalone --nproc_per_node=2 cleanrl_ddp/dqn_atari_multigpu.py
    # 2 nodes x 8 processes: run on every node, with NODE_RANK 0 on the node at HOST
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \
        --master_addr=HOST --master_port=29500 cleanrl_ddp/dqn_atari_multigpu.py
    # SLURM: one task per process, MASTER_ADDR/MASTER_PORT exported (see benchmark/slurm/)
    srun --ntasks=16 --ntasks-per-node=8 python cleanrl_ddp/dqn_atari_multigpu.py

Every rank steps its own `--local-num-envs` Atari games and keeps its own replay buffer of them;
each gradient update samples `--local-batch-size` transitions per rank and averages the
gradients across ranks (DDP, or one flattened all-reduce with `--grad-sync flat`). Epsilon,
learning starts, train frequency, target-network syncs, logging and evaluation all follow the
GLOBAL step, so every rank makes the same decision at the same moment.
"""

import io
import os
import random
import re
import signal
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
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

SCRIPT = os.path.basename(__file__)[: -len(".py")]
EXIT_BAD_INPUT = 2
"""exit code: invalid flags, environment, checkpoint or run directory (nothing was overwritten)"""
EXIT_DIVERGED = 3
"""exit code: `--sync-check-every` found replicas whose parameters or optimizer state differ"""
EXIT_LOST_RANK = 4
"""exit code: a collective failed: another rank died, stalled past `--dist-timeout`, or the network broke"""
EXIT_PREEMPTED = 75
"""exit code: stopped by SIGTERM/SIGUSR1 after saving a checkpoint; relaunch to resume (EX_TEMPFAIL)"""
STACK_NUM = 4
"""frames per observation (DeepMind's frame stack)"""
FRAME_SHAPE = (84, 84)
"""one grayscale, resized frame"""


@dataclass
class Args:
    exp_name: str = SCRIPT
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment; rank r's envs and sampling streams are derived from it"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled and CUDA is available, train on `cuda:{local_rank}`"""
    track: bool = False
    """if toggled, log to Weights and Biases (one run per job, from rank 0)"""
    wandb_project_name: str = "cleanrl_ddp"
    """the W&B project name"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team)"""
    runs_dir: str = "runs"
    """the directory that holds one sub-directory per run (TensorBoard events, checkpoint.pt)"""
    run_name: Optional[str] = None
    """the run's directory name; default `{env_id}__{exp_name}__{seed}__{launch id}`, stable across elastic restarts"""

    # Algorithm specific arguments
    env_id: str = "BreakoutNoFrameskip-v4"
    """the Atari game: `BreakoutNoFrameskip-v4`, `ALE/Breakout-v5` or an ALE ROM name such as `breakout`"""
    repeat_action_probability: Optional[float] = None
    """sticky actions; default 0.25 for `ALE/*-v5` ids (Machado et al., 2018), else 0.0 (the v4 protocol)"""
    total_timesteps: int = 10000000
    """env steps (agent steps, 4 frames each) of the whole run, summed over all ranks"""
    learning_rate: float = 1e-4
    """the learning rate of the optimizer"""
    local_num_envs: int = 1
    """the number of parallel environments on each rank"""
    buffer_size: int = 1000000
    """transitions held by the replay memory of ALL ranks together (each rank keeps its own share)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate (1.0 = copy)"""
    target_network_frequency: int = 1000
    """global steps between target-network updates"""
    local_batch_size: int = 32
    """transitions each rank samples from its own buffer per gradient update"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.10
    """the fraction of `total-timesteps` over which epsilon falls from start-e to end-e"""
    learning_starts: int = 80000
    """global step after which gradient updates start"""
    train_frequency: int = 4
    """global steps between gradient updates"""

    # Evaluation
    eval_every: int = 0
    """run evaluation episodes on rank 0 every N global steps (0 = never)"""
    eval_episodes: int = 10
    """whole-game episodes per evaluation, played in parallel on rank 0"""
    eval_epsilon: float = 0.05
    """epsilon of the evaluation policy (0 = purely greedy; 0.05 as in Mnih et al. 2015 and CleanRL)"""
    target_return: Optional[float] = None
    """stop every rank (after a checkpoint) once an evaluation's mean return reaches this"""
    capture_video: bool = False
    """record each evaluation's first game to {run dir}/videos and TensorBoard/W&B (needs the video extra)"""
    log_every: int = 1000
    """global steps between logged (all-reduced) metrics"""

    # Distributed
    grad_sync: Literal["ddp", "flat"] = "ddp"
    """how gradients are averaged: DistributedDataParallel, or one all-reduce of all gradients flattened"""
    backend: Optional[Literal["nccl", "gloo"]] = None
    """the torch.distributed backend; default NCCL on CUDA, gloo on CPU"""
    dist_timeout: float = 300.0
    """seconds a collective may wait for a missing or stalled rank (also for rank 0's evaluation)"""
    share_gpus: bool = False
    """allow more ranks per node than visible GPUs (rank uses cuda:{local_rank % num_gpus})"""
    sync_check_every: int = 0
    """every N global steps compare network and optimizer checksums across ranks (0 = off)"""

    # Fault tolerance
    checkpoint_every: int = 100000
    """write checkpoint.pt every N global steps (0 = only at the end, at a stop and on preemption)"""
    resume: Optional[str] = None
    """continue from a run directory or a checkpoint.pt file (its flags are the defaults; flags given here win)"""


def derive_sizes(args: Args, world_size: int) -> dict:
    """Global and per-rank sizes from the flags and the world size; raises ValueError on bad input."""
    for name in (
        "local_num_envs",
        "local_batch_size",
        "total_timesteps",
        "buffer_size",
        "train_frequency",
        "target_network_frequency",
        "log_every",
        "eval_episodes",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    num_envs = args.local_num_envs * world_size
    if args.buffer_size % num_envs != 0:
        raise ValueError(
            f"--buffer-size {args.buffer_size} does not divide among {num_envs} envs "
            f"({world_size} ranks x --local-num-envs {args.local_num_envs})"
        )
    env_buffer_capacity = args.buffer_size // num_envs
    if env_buffer_capacity < STACK_NUM + 2:
        raise ValueError(
            f"--buffer-size {args.buffer_size} leaves {env_buffer_capacity} slots per env; each env needs at "
            f"least {STACK_NUM + 2} (a frame stack and its next observation)"
        )
    if args.learning_starts < num_envs:
        raise ValueError(
            f"--learning-starts must be at least the number of envs ({num_envs}), got {args.learning_starts}"
        )
    num_iterations = args.total_timesteps // num_envs
    if num_iterations < 1:
        raise ValueError(f"--total-timesteps {args.total_timesteps} is smaller than one step of all {num_envs} envs")
    return dict(
        world_size=world_size,
        num_envs=num_envs,
        batch_size=args.local_batch_size * world_size,
        local_buffer_size=args.buffer_size // world_size,
        env_buffer_capacity=env_buffer_capacity,
        num_iterations=num_iterations,
        replay_ratio=args.local_batch_size * world_size / args.train_frequency,
    )


def ale_game(env_id: str) -> str:
    """The ALE ROM name for `BreakoutNoFrameskip-v4`, `ALE/Breakout-v5`, `Breakout` or `breakout`."""
    name = env_id.removeprefix("ALE/")
    name = re.sub(r"(NoFrameskip|Deterministic)?-v[0-9]+$", "", name)
    game = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()  # MsPacman -> ms_pacman
    if game not in ale_py.roms.get_all_rom_ids():
        raise ValueError(
            f"unknown --env-id {env_id!r}: not an ALE game; try BreakoutNoFrameskip-v4, ALE/Pong-v5 or "
            f"space_invaders (one of {len(ale_py.roms.get_all_rom_ids())} ROMs in ale_py.roms.get_all_rom_ids())"
        )
    return game


def sticky_action_probability(args: Args) -> float:
    if args.repeat_action_probability is not None:
        return args.repeat_action_probability
    return 0.25 if args.env_id.startswith("ALE/") and args.env_id.endswith("-v5") else 0.0


def make_env(env_id: str, num_envs: int, num_threads: int = 1, repeat_action_probability: float = 0.0):
    """`num_envs` games in ALE's C++ vector env, with the DeepMind preprocessing done in C++.

    Noop reset (up to 30), frame skip 4 with max-pooling, fire on reset, 84x84 grayscale, 4-frame
    stack (zeros before the first frame of a game), 108k-frame cap, as CleanRL's NoFrameskip-v4
    wrappers. Rewards come back unclipped and life losses do not end the episode: the training loop
    clips rewards and turns life losses into terminations itself (`life_lost`), so that the logged
    returns are whole games. ALE 0.12's own `episodic_life` restarts the whole game at every life
    loss. Autoreset is NextStep: the step after a game's last observation resets that env, so the
    last observation itself is returned and can be stored as the next_obs of the final transition.
    """
    return AtariVectorEnv(
        ale_game(env_id),
        num_envs,
        num_threads=num_threads,
        max_num_frames_per_episode=108000,
        repeat_action_probability=repeat_action_probability,
        noop_max=30,
        frameskip=4,
        maxpool=True,
        img_height=FRAME_SHAPE[0],
        img_width=FRAME_SHAPE[1],
        grayscale=True,
        stack_num=STACK_NUM,
        use_fire_reset=True,
        episodic_life=False,
        life_loss_info=False,
        reward_clipping=False,
        autoreset_mode="NextStep",
    )


def make_eval_envs(
    env_id: str,
    num_envs: int,
    video_dir: Optional[str] = None,
    repeat_action_probability: Optional[float] = None,
    num_threads: int = 1,
) -> AtariVectorEnv:
    """Rank 0's evaluation games: `make_env`'s preprocessing in a vector env of their own, never the training one.

    ALE's vector env cannot render, so `evaluate` writes env 0's frames to {video_dir}/{video_name}.mp4 itself.
    Sticky actions default to the protocol of `env_id` (0.25 for `ALE/*-v5`, else 0).
    """
    if repeat_action_probability is None:
        repeat_action_probability = sticky_action_probability(Args(env_id=env_id))
    envs = make_env(env_id, num_envs, min(num_threads, num_envs), repeat_action_probability)
    envs.video_dir = video_dir  # where `evaluate` writes videos (None: it records none)
    return envs


# ALGO LOGIC: initialize agent here:
class QNetwork(nn.Module):
    """The Nature-DQN CNN (Mnih et al. 2015), as in CleanRL's dqn_atari.py (PyTorch default init)."""

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


class FrameReplayBuffer:
    """The replay memory of one rank's envs; every 84x84 frame is stored once, as uint8.

    One ring of slots per env, all written in lockstep. Slot t of env e holds the NEWEST frame of
    the observation the agent saw at step t, the action it took, the clipped reward and whether
    the step terminated (a life loss or the end of the game). `first` marks a slot whose
    observation came from a reset; `final` marks a game's last observation, from which the env
    resets instead of acting (NextStep autoreset), so it is the next_obs of the slot before it
    but not a transition of its own.

    Stacks are rebuilt at sample time from the STACK_NUM newest slots, with zero frames before an
    episode's first slot (exactly what the env shows after a reset); next_obs is the stack at
    t + 1. A transition is sampled only when its next slot is written and, once the ring has
    wrapped, when its stack reaches no slot that newer data has overwritten.
    """

    def __init__(self, capacity: int, num_envs: int, frame_shape=FRAME_SHAPE, stack_num: int = STACK_NUM):
        self.capacity, self.num_envs, self.stack_num = capacity, num_envs, stack_num
        self.frames = np.zeros((num_envs, capacity, *frame_shape), dtype=np.uint8)
        self.actions = np.zeros((num_envs, capacity), dtype=np.uint8)  # ALE has at most 18 actions
        self.rewards = np.zeros((num_envs, capacity), dtype=np.float32)
        self.terminated = np.zeros((num_envs, capacity), dtype=bool)
        self.first = np.zeros((num_envs, capacity), dtype=bool)
        self.final = np.zeros((num_envs, capacity), dtype=bool)
        self.pos = 0  # the slot written next (the same for every env)
        self.size = 0

    def add(self, frame, action, reward, terminated, first, final) -> None:
        """Store one step of every env: arrays of shape [num_envs, ...]."""
        p = self.pos
        self.frames[:, p] = frame
        self.actions[:, p] = action
        self.rewards[:, p] = reward
        self.terminated[:, p] = terminated
        self.first[:, p] = first
        self.final[:, p] = final
        self.pos = (p + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def stack(self, env_idx: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """The frame stacks ending at physical `slot` of envs `env_idx`: uint8 [B, stack_num, H, W]."""
        slots = (slot[:, None] + np.arange(1 - self.stack_num, 1)) % self.capacity  # oldest .. newest
        first = self.first[env_idx[:, None], slots]
        # a frame is part of the stack unless an episode starts AFTER it (at a later position in the stack)
        starts_at_or_after = np.flip(np.cumsum(np.flip(first, 1), 1), 1)
        keep = (starts_at_or_after - first) == 0
        return self.frames[env_idx[:, None], slots] * keep[:, :, None, None].astype(np.uint8)

    def transitions(self, env_idx: np.ndarray, slot: np.ndarray) -> dict:
        """The transitions at physical `slot` of envs `env_idx` (the caller checked they are valid)."""
        return dict(
            obs=self.stack(env_idx, slot),
            actions=self.actions[env_idx, slot].astype(np.int64),
            rewards=self.rewards[env_idx, slot],
            next_obs=self.stack(env_idx, (slot + 1) % self.capacity),
            terminated=self.terminated[env_idx, slot],
        )

    def sample(self, batch_size: int, rng=np.random) -> dict:
        """Uniform over the valid transitions of all envs (rejecting `final` slots and redrawing them).

        `rng` is a `np.random.RandomState` (the script passes the rank's global stream, which checkpoints hold).
        """
        if self.size < 2:
            raise ValueError("the replay buffer needs at least two steps before sampling")
        # logical age 0 is the oldest slot; the newest slot (age size - 1) has no next_obs yet
        oldest = self.pos if self.size == self.capacity else 0
        low = self.stack_num - 1 if self.size == self.capacity else 0  # older stacks reach overwritten slots
        env_idx = rng.randint(0, self.num_envs, batch_size)
        slot = (oldest + rng.randint(low, self.size - 1, batch_size)) % self.capacity
        redraw = self.final[env_idx, slot]
        while redraw.any():
            env_idx[redraw] = rng.randint(0, self.num_envs, int(redraw.sum()))
            slot[redraw] = (oldest + rng.randint(low, self.size - 1, int(redraw.sum()))) % self.capacity
            redraw = self.final[env_idx, slot]
        return self.transitions(env_idx, slot)


# ALGO LOGIC: pure functions, imported by the tests
def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def steps_crossed(prev_step: int, global_step: int, every: int) -> int:
    """How many multiples of `every` lie in (prev_step, global_step]: the schedule of periodic events.

    The global step grows by `num_envs` per iteration, so a period that is not a multiple of it is
    still kept on average, and every rank computes the same answer from the same global step.
    """
    return global_step // every - prev_step // every if every > 0 else 0


def life_lost(lives: np.ndarray, prev_lives: np.ndarray) -> np.ndarray:
    """CleanRL's EpisodicLifeEnv condition: a life was lost but the game goes on."""
    return (lives < prev_lives) & (lives > 0)


def td_loss(model, target_network, obs, actions, rewards, next_obs, terminated, gamma: float):
    """CleanRL's DQN loss on one local batch: MSE to the target network's one-step TD target.

    `model` is the DDP-wrapped Q-network (or the plain one). Returns (loss, mean Q of the taken actions).
    """
    with torch.no_grad():
        target_max, _ = target_network(next_obs).max(dim=1)
        td_target = rewards + gamma * target_max * (1 - terminated)
    old_val = model(obs).gather(1, actions.view(-1, 1)).squeeze(1)
    return F.mse_loss(td_target, old_val), old_val.mean().detach()


def all_reduce_gradients_flat(params, world_size: int) -> None:
    """Average gradients across ranks with one all-reduce of one flat buffer (instead of DDP).

    After cswinter's batched scheme (entity-neural-network/incubator#220), used by CleanRL.
    """
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def state_checksum(agent: nn.Module, optimizer: optim.Optimizer) -> torch.Tensor:
    """A cheap fingerprint of the exact bits of parameters and optimizer state (int64 [2])."""
    total = torch.zeros(2, dtype=torch.int64, device=next(agent.parameters()).device)
    tensors = list(agent.state_dict().values())
    for state in optimizer.state_dict()["state"].values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        bits = t.detach().reshape(-1).to(total.device)
        bits = bits.view(torch.int32) if bits.dtype == torch.float32 else bits.to(torch.int64)
        bits = bits.to(torch.int64)
        total[0] += bits.sum()
        total[1] += (bits * torch.arange(1, bits.numel() + 1, device=bits.device)).sum()
    return total


def check_replicas_in_sync(agent, optimizer, iteration: int, world_size: int) -> None:
    """Raise RuntimeError on every rank, naming the ranks, if any replica differs from rank 0."""
    local = state_checksum(agent, optimizer)
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    bad = [r for r in range(1, world_size) if not torch.equal(gathered[r], gathered[0])]
    if bad:
        raise RuntimeError(
            f"replicas diverged at iteration {iteration}: rank(s) {bad} hold parameters or optimizer "
            "state that differ from rank 0's"
        )


def evaluate(q_network, eval_envs, epsilon: float, seed: int, device, video_name: Optional[str] = None):
    """Play one whole game in each env of `eval_envs`, epsilon-greedily; returns (returns, lengths, video). Rank 0 only.

    Returns are unclipped game scores, like `charts/episodic_return`. Exploration draws from a generator
    of its own, so that evaluating never moves the training streams. With `video_name` (and envs from
    `make_eval_envs(..., video_dir)`) env 0's game is written as {video_dir}/{video_name}.mp4, one frame
    per agent step (the newest 84x84 frame of each observation), and `video` is dict(path, frames
    [T, H, W, 3] uint8, fps); otherwise it is None.
    """
    episodes = eval_envs.num_envs
    rng = np.random.default_rng(seed)
    obs, _ = eval_envs.reset(seed=np.arange(seed, seed + episodes, dtype=np.int64))
    frames = [obs[0, -1]] if video_name is not None else None  # the first frame, before any action
    returns, lengths = np.zeros(episodes), np.zeros(episodes, dtype=np.int64)
    running = np.ones(episodes, dtype=bool)
    n_actions = int(eval_envs.single_action_space.n)
    while running.any():
        explore = rng.random(episodes) < epsilon
        actions = rng.integers(0, n_actions, episodes)
        if not explore.all():
            with torch.no_grad():
                greedy = q_network(torch.as_tensor(obs, device=device)).argmax(dim=1).cpu().numpy()
            actions = np.where(explore, actions, greedy)
        obs, reward, terminations, truncations, _ = eval_envs.step(actions)
        returns += reward * running
        lengths += running
        if frames is not None and running[0]:  # NextStep autoreset: a game's last obs is still its own
            frames.append(obs[0, -1])
        running &= ~(terminations | truncations)  # later steps of that env are ignored
    if frames is None:
        return returns, lengths, None
    from moviepy.video.io.ImageSequenceClip import ImageSequenceClip

    fps = 15  # 60 emulator frames per second, 4 per agent step: real time
    rgb = np.repeat(np.stack(frames)[..., None], 3, axis=-1)  # grayscale -> [T, H, W, 3]
    os.makedirs(eval_envs.video_dir, exist_ok=True)
    path = os.path.join(eval_envs.video_dir, f"{video_name}.mp4")
    ImageSequenceClip(list(rgb), fps=fps).write_videofile(path, logger=None)
    return returns, lengths, dict(path=path, frames=rgb, fps=fps)


def log_video(writer, video: dict, global_step: int, track: bool) -> None:
    """Attach an evaluation video (from `evaluate`) to TensorBoard and, with --track, to W&B. Rank 0 only."""
    frames = video["frames"][:: max(1, len(video["frames"]) // 200)]  # TensorBoard stores a GIF: keep it small
    fps = video["fps"] * len(frames) / len(video["frames"])
    writer.add_video("eval/video", frames.transpose(0, 3, 1, 2)[None], global_step, fps=max(1, round(fps)))
    if track:
        import wandb

        wandb.log({"eval/video": wandb.Video(video["path"], format="mp4")})


# TRY NOT TO MODIFY: launch, run directory, checkpoints
class RunError(Exception):
    """An error the user can fix; printed as one line by rank 0, then exit with `code`."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.code = code


def lost_rank_message(e: Exception) -> Optional[str]:
    """The reason, if `e` is what a collective raises when a peer died or stalled past the timeout, else None."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if not (isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo" in text.lower())):
        return None
    return text.split("] ", 1)[-1].split(". This is typically", 1)[0][:160]  # drop the C++ source prefix


def read_launch_env() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's or SLURM's variables."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (or any env:// launcher)
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", 0))
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", 1))
    elif int(env.get("SLURM_NTASKS", 1)) > 1:  # srun, one task per process
        rank, world_size = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local_rank = int(env.get("SLURM_LOCALID", 0))
        local_world_size = int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in env:
                raise RunError(f"under srun, export {var} (e.g. the first host of the job and a free port)")
    else:
        rank, local_rank, world_size, local_world_size = 0, 0, 1, 1
    return rank, local_rank, world_size, local_world_size


def launch_id() -> str:
    """An id that names this launch and survives torchrun elastic restarts and SLURM requeues."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id not in ("", "none"):
        return run_id
    if "SLURM_JOB_ID" in os.environ:
        return "slurm" + os.environ["SLURM_JOB_ID"]
    return str(int(time.time()))


def check_elastic_restarts(args: Args) -> None:
    """Under torchrun --max-restarts, refuse launches whose restarted workers could not continue the run."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) == 0:
        return
    # torchrun shares one TCPStore across restarts (torch >= 2.4, and always with the static rendezvous):
    # restarted workers read the previous attempt's addresses and fail to connect (pytorch#135712).
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RunError(
            "torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 exported and the c10d rendezvous "
            "(--standalone, or --rdzv-backend=c10d): otherwise restarted workers fail to connect (pytorch#135712)"
        )
    stable_id = os.environ.get("TORCHELASTIC_RUN_ID", "none") not in ("", "none") or "SLURM_JOB_ID" in os.environ
    if not stable_id and args.run_name is None:  # launch_id() would be a time stamp: a restart starts a new run
        raise RunError("torchrun --max-restarts needs a run name that survives restarts: pass --rdzv-id=JOB_ID")


def atomic_save(obj, path: str) -> None:
    """Write `obj` so that a crash at any instant leaves either the old or the new file, never a torn one.

    Serialised in memory first, so that a full disk raises a plain OSError (ENOSPC, EFBIG) from
    `write`, not an error from inside torch's zip writer.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str) -> dict:
    """Load and validate a checkpoint of this script; raise RunError with the reason."""
    if os.path.isdir(path):
        path = os.path.join(path, "checkpoint.pt")
    if not os.path.isfile(path):
        raise RunError(f"--resume: no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise RunError(f"--resume: {path} is truncated or corrupt ({type(e).__name__}); it was left as it is")
    if not isinstance(ckpt, dict) or ckpt.get("script") != SCRIPT:
        found = ckpt.get("script") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise RunError(f"--resume: {path} was written by {found!r}, not {SCRIPT}")
    required = {"args", "world_size", "sizes", "iteration", "global_step", "optimizer", "rng"}
    required |= {"q_network", "target_network", "num_updates", "num_target_updates"}  # DQN's own state
    missing = required - ckpt.keys()
    if missing:
        raise RunError(f"--resume: {path} lacks {', '.join(sorted(missing))}; it was left as it is")
    return ckpt


def rng_states(device: torch.device) -> dict:
    states = dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state())
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def main() -> int:
    args = tyro.cli(Args)
    rank, local_rank, world_size, local_world_size = read_launch_env()
    is_main = rank == 0  # rank-0 decisions use the GLOBAL rank; the device uses the LOCAL rank
    # Preemption: SIGTERM/SIGUSR1 only set a flag; all ranks stop together at the next logging boundary.
    stop_signal = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))
    try:
        # with --resume the checkpoint's flags are merged in first; rank 0 derives the sizes then
        sizes = None if args.resume else derive_sizes(args, world_size)
        ale_game(args.env_id)  # raises ValueError for an unknown game
        for name in ("checkpoint_every", "sync_check_every", "eval_every"):
            if getattr(args, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be 0 (off) or positive")
        if args.target_return is not None and not args.eval_every:
            raise ValueError("--target-return needs --eval-every N (the evaluation decides the stop)")
        if args.capture_video and not args.eval_every:
            raise ValueError("--capture-video needs --eval-every N (videos are of the evaluation games)")
        if args.capture_video:
            try:
                import moviepy  # noqa: F401 (evaluate writes the MP4s with it, TensorBoard's add_video too)
            except ImportError:
                raise ValueError("--capture-video needs moviepy: pip install -e '.[video]'") from None
        if not args.dist_timeout > 0:
            raise ValueError(f"--dist-timeout must be positive (seconds), got {args.dist_timeout}")
    except ValueError as e:
        raise RunError(str(e))
    check_elastic_restarts(args)
    if args.sync_check_every and world_size == 1:
        args.sync_check_every = 0  # nothing to compare

    # Backend and device: NCCL on CUDA, gloo on CPU
    use_cuda = args.cuda and torch.cuda.is_available() and args.backend != "gloo"
    if use_cuda:
        n_gpus = torch.cuda.device_count()
        if local_rank >= n_gpus and not args.share_gpus:
            raise RunError(
                f"local rank {local_rank} needs cuda:{local_rank} but this node shows {n_gpus} GPU(s); launch "
                f"at most {n_gpus} processes per node, or pass --share-gpus, or --no-cuda"
            )
        device = torch.device("cuda", local_rank % n_gpus)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if args.backend == "nccl" and not use_cuda:
        raise RunError("--backend nccl needs CUDA; use --backend gloo (or omit it) on CPU")
    # Each rank gets its share of the cores it may run on (torchrun would otherwise leave 1).
    cores_per_rank = max(1, len(os.sched_getaffinity(0)) // local_world_size)
    torch.set_num_threads(cores_per_rank)
    if world_size > 1:
        dist.init_process_group(
            backend=args.backend or ("nccl" if use_cuda else "gloo"),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=args.dist_timeout),
            device_id=device if use_cuda else None,
        )

    # Run directory, checkpoint to resume from, loggers: rank 0 decides, every rank learns the outcome.
    setup = None
    if is_main:
        try:
            run_name = args.run_name or f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__{launch_id()}"
            run_dir = os.path.join(args.runs_dir, run_name)
            resume_from = args.resume
            if resume_from is None and os.path.isfile(os.path.join(run_dir, "checkpoint.pt")):
                resume_from = run_dir  # an elastic restart or a requeued job: continue the same run
            ckpt = load_checkpoint(resume_from) if resume_from else None
            if ckpt is not None:
                if args.resume:  # continue writing into the directory of the checkpoint
                    run_dir = args.resume if os.path.isdir(args.resume) else os.path.dirname(args.resume) or "."
                # A resumed run takes the checkpoint's flags as its defaults (same schedules, seed, env);
                # flags given on this command line still win.
                saved = {k: v for k, v in ckpt["args"].items() if k in {f.name for f in fields(Args)}}
                args = tyro.cli(Args, default=Args(**saved))
                if args.env_id != saved["env_id"]:  # the id also sets the protocol (sticky actions)
                    raise RunError(f"--resume: {resume_from} trained {saved['env_id']}, not --env-id {args.env_id}")
                if ckpt["world_size"] != world_size:
                    raise RunError(
                        f"--resume: the checkpoint was written with world size {ckpt['world_size']} (global batch "
                        f"{ckpt['sizes']['batch_size']}); relaunch with {ckpt['world_size']} processes"
                    )
                try:
                    sizes = derive_sizes(args, world_size)
                except ValueError as e:
                    raise RunError(str(e))
            try:
                os.makedirs(run_dir, exist_ok=True)
                probe = os.path.join(run_dir, f".write-test.{os.getpid()}")
                open(probe, "w").close()
                os.remove(probe)
            except OSError as e:
                raise RunError(f"cannot write to the run directory {run_dir}: {e.strerror}")
            setup = dict(run_dir=run_dir, ckpt=ckpt, args=args, sizes=sizes)
        except RunError as e:
            setup = e
    if world_size > 1:
        box = [setup]
        dist.broadcast_object_list(box, src=0)
        setup = box[0]
    if isinstance(setup, RunError):
        raise setup
    run_dir, ckpt, args, sizes = setup["run_dir"], setup["ckpt"], setup["args"], setup["sizes"]
    start_iteration = ckpt["iteration"] + 1 if ckpt else 1
    global_step = ckpt["global_step"] if ckpt else 0
    # The replay buffer is not checkpointed (7 GB at the default size): after a resume every rank refills
    # its buffer for `learning_starts` global steps before updates continue.
    train_start = args.learning_starts + (global_step if ckpt else 0)

    writer = None
    wandb_run_id = ckpt.get("wandb_run_id") if ckpt else None
    if is_main:
        from torch.utils.tensorboard import SummaryWriter

        if args.track:
            import wandb

            # a resumed run passes the id saved in its checkpoint; a new one keeps the id W&B chose
            wandb_run_id = wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                sync_tensorboard=True,
                config={**vars(args), **sizes},
                name=os.path.basename(run_dir),
                id=wandb_run_id,
                resume="allow",
                save_code=True,
            ).id
        # purge_step drops events a crashed attempt logged after the checkpoint: no duplicate steps
        writer = SummaryWriter(run_dir, purge_step=global_step + 1 if ckpt else None)
        writer.add_text(
            "hyperparameters",
            "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in {**vars(args), **sizes}.items()),
        )
        print(f"{SCRIPT}: {args.env_id} (ROM {ale_game(args.env_id)}), run directory {run_dir}")
        for key, value in sizes.items():
            print(f"  {key:<22}{value}")
        dropped = args.total_timesteps - sizes["num_iterations"] * sizes["num_envs"]
        if dropped:
            print(f"  ({dropped} steps of --total-timesteps {args.total_timesteps} do not fill an iteration)")
        if ckpt:
            print(
                f"  resuming at iteration {start_iteration}, global step {global_step}; "
                f"updates restart at {train_start} (buffer refill)"
            )

    # CRUCIAL: every rank starts from the same weights, but steps its own envs with its own seeds and
    # samples actions and minibatches from its own stream. Env seeds are global env indices (disjoint across ranks).
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    local_num_envs = args.local_num_envs
    sticky = sticky_action_probability(args)
    envs = make_env(args.env_id, local_num_envs, min(local_num_envs, cores_per_rank), sticky)
    n_actions = int(envs.single_action_space.n)
    # what QNetwork's constructor needs, saved in checkpoints so that cleanrl_ddp/evaluate.py can rebuild it
    agent_kwargs = dict(n_actions=n_actions)
    q_network = QNetwork(**agent_kwargs).to(device)
    if world_size > 1:
        for tensor in q_network.state_dict().values():  # identical start whichever --grad-sync is used
            dist.broadcast(tensor, src=0)
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(n_actions).to(device)
    target_network.load_state_dict(q_network.state_dict())  # a copy of the synchronised online net
    rank_seed = int(np.random.SeedSequence([args.seed, rank]).generate_state(1)[0])
    random.seed(rank_seed)
    np.random.seed(rank_seed)
    torch.manual_seed(rank_seed)
    if ckpt:
        q_network.load_state_dict(ckpt["q_network"])
        target_network.load_state_dict(ckpt["target_network"])
        optimizer.load_state_dict(ckpt["optimizer"])
        set_rng_states(ckpt["rng"][rank], device)
    model = q_network
    if world_size > 1 and args.grad_sync == "ddp":
        model = DDP(q_network, device_ids=[device.index] if use_cuda else None)
    # both networks in one module, so that --sync-check-every compares the target network too
    replicas = nn.ModuleDict(dict(q_network=q_network, target_network=target_network))
    eval_envs = None
    if is_main and args.eval_every:
        video_dir = os.path.join(run_dir, "videos") if args.capture_video else None
        eval_envs = make_eval_envs(args.env_id, args.eval_episodes, video_dir, sticky, cores_per_rank)

    # A resumed run seeds its envs past the seeds earlier attempts used (env state is not checkpointed).
    env_seed0 = args.seed + rank * local_num_envs + (start_iteration - 1) * sizes["num_envs"]
    obs, infos = envs.reset(seed=np.arange(env_seed0, env_seed0 + local_num_envs, dtype=np.int64))
    rb = FrameReplayBuffer(sizes["env_buffer_capacity"], local_num_envs)

    obs_first = np.ones(local_num_envs, dtype=bool)  # `obs` came from a reset
    obs_final = np.zeros(local_num_envs, dtype=bool)  # `obs` is a game's last: the next step resets
    prev_lives = infos["lives"].copy()
    episode_return = np.zeros(local_num_envs)
    episode_length = np.zeros(local_num_envs, dtype=np.int64)
    recent_returns = deque(maxlen=100)
    # sums since the last logging boundary: episodes (return, length, count), updates (loss, q, count)
    episode_stats, update_stats = np.zeros(3), torch.zeros(3, dtype=torch.float64, device=device)
    num_updates = ckpt["num_updates"] if ckpt else 0
    num_target_updates = ckpt["num_target_updates"] if ckpt else 0
    eval_seconds = 0.0  # excluded from SPS
    update_seconds = grad_sync_seconds = 0.0  # rank 0's time in updates and in the flat all-reduce, per log interval
    sps_window = deque([(time.time(), global_step)], maxlen=11)
    num_iterations = sizes["num_iterations"]
    show_live = is_main and sys.stdout.isatty()
    exit_code = 0
    for iteration in range(start_iteration, num_iterations + 1):
        prev_step = global_step
        global_step += sizes["num_envs"]  # global: all ranks step at once

        # ALGO LOGIC: put action logic here (epsilon from the GLOBAL step: the same on every rank)
        epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, prev_step)
        explore = np.random.random(local_num_envs) < epsilon
        actions = np.random.randint(0, n_actions, local_num_envs)
        if not explore.all():
            with torch.no_grad():  # the unwrapped network: inference must not go through DDP
                greedy = q_network(torch.as_tensor(obs, device=device)).argmax(dim=1).cpu().numpy()
            actions = np.where(explore, actions, greedy)

        # TRY NOT TO MODIFY: execute the game and log data.
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        lives = infos["lives"]
        game_over = (terminations | truncations) & ~obs_final  # a step from a final obs is the reset
        # episodic life (Mnih et al. 2015): a lost life ends the episode for learning, not for logging
        terminated = (terminations | life_lost(lives, prev_lives)) & ~obs_final
        episode_return += rewards * ~obs_final
        episode_length += ~obs_final
        if game_over.any():
            episode_stats += (episode_return[game_over].sum(), episode_length[game_over].sum(), game_over.sum())
            episode_return[game_over] = 0
            episode_length[game_over] = 0

        # TRY NOT TO MODIFY: save data to the replay buffer (one frame per step: the newest of the stack)
        rb.add(obs[:, -1], actions, np.sign(rewards), terminated, obs_first, obs_final)
        obs_first, obs_final = obs_final, game_over  # the step after a final obs is an autoreset
        prev_lives = lives.copy()
        obs = next_obs

        # ALGO LOGIC: training. The number of updates and the target syncs depend on the GLOBAL step
        # only, so every rank runs the same number of DDP all-reduces.
        if global_step > train_start:
            update_start = time.perf_counter()
            for _ in range(steps_crossed(prev_step, global_step, args.train_frequency)):
                data = rb.sample(args.local_batch_size)
                loss, q_mean = td_loss(
                    model,
                    target_network,
                    torch.as_tensor(data["obs"], device=device),
                    torch.as_tensor(data["actions"], device=device),
                    torch.as_tensor(data["rewards"], device=device),
                    torch.as_tensor(data["next_obs"], device=device),
                    torch.as_tensor(data["terminated"], dtype=torch.float32, device=device),
                    args.gamma,
                )
                optimizer.zero_grad(set_to_none=False)
                loss.backward()
                if world_size > 1 and args.grad_sync == "flat":
                    sync_start = time.perf_counter()
                    all_reduce_gradients_flat(list(q_network.parameters()), world_size)
                    grad_sync_seconds += time.perf_counter() - sync_start
                optimizer.step()
                update_stats += torch.stack([loss.detach().double(), q_mean.double(), torch.ones((), device=device)])
                num_updates += 1
            if steps_crossed(prev_step, global_step, args.target_network_frequency):
                # every rank copies its (identical) online network at the same global step
                with torch.no_grad():
                    for target_param, q_param in zip(target_network.parameters(), q_network.parameters(), strict=True):
                        target_param.copy_(args.tau * q_param + (1.0 - args.tau) * target_param)
                num_target_updates += 1
            update_seconds += time.perf_counter() - update_start

        last = iteration == num_iterations
        preempted = False
        if steps_crossed(prev_step, global_step, args.log_every) or last:
            # One all-reduce per logging interval carries every metric, plus the stop flag of any preempted rank.
            metrics = torch.cat(
                [update_stats, torch.tensor([*episode_stats, float(bool(stop_signal))], device=device).double()]
            )
            if world_size > 1:
                dist.all_reduce(metrics)
            loss_sum, q_sum, n_upd, ep_return_sum, ep_length_sum, ep_count, stop_votes = metrics.tolist()
            episode_stats[:] = 0
            update_stats.zero_()
            interval_update_seconds, interval_sync_seconds = update_seconds, grad_sync_seconds
            update_seconds = grad_sync_seconds = 0.0
            preempted = stop_votes > 0
            now = time.time() - eval_seconds
            sps_window.append((now, global_step))
            sps = int((sps_window[-1][1] - sps_window[0][1]) / max(sps_window[-1][0] - sps_window[0][0], 1e-9))
            if is_main:
                # TRY NOT TO MODIFY: record rewards for plotting purposes
                if ep_count:
                    writer.add_scalar("charts/episodic_return", ep_return_sum / ep_count, global_step)
                    writer.add_scalar("charts/episodic_length", ep_length_sum / ep_count, global_step)
                    recent_returns.append(ep_return_sum / ep_count)
                writer.add_scalar("charts/episodes", ep_count, global_step)
                writer.add_scalar("charts/epsilon", epsilon, global_step)
                if n_upd:
                    writer.add_scalar("losses/td_loss", loss_sum / n_upd, global_step)
                    writer.add_scalar("losses/q_values", q_sum / n_upd, global_step)
                writer.add_scalar("charts/updates", num_updates, global_step)
                writer.add_scalar("charts/target_updates", num_target_updates, global_step)
                writer.add_scalar("charts/SPS", sps, global_step)
                writer.add_scalar("perf/update_seconds", interval_update_seconds, global_step)
                if world_size > 1 and args.grad_sync == "flat":
                    writer.add_scalar("perf/grad_sync_seconds", interval_sync_seconds, global_step)
                line = (
                    f"step {global_step}/{num_iterations * sizes['num_envs']}  SPS {sps}  epsilon {epsilon:.3f}  "
                    f"return {np.mean(recent_returns) if recent_returns else float('nan'):.1f}"
                )
                log_count = num_iterations * sizes["num_envs"] // args.log_every
                if show_live:
                    print("\r" + line, end="\n" if last else "", flush=True)
                elif last or steps_crossed(prev_step, global_step, max(1, log_count // 10) * args.log_every):
                    print(line, flush=True)

        if steps_crossed(prev_step, global_step, args.sync_check_every):
            try:
                check_replicas_in_sync(replicas, optimizer, iteration, world_size)
            except RuntimeError as e:
                raise RunError(str(e), EXIT_DIVERGED)

        # Evaluation on rank 0; the result and the stop decision are broadcast, so all ranks stop together.
        reached = False
        if steps_crossed(prev_step, global_step, args.eval_every):
            started = time.time()
            result = torch.zeros(3, dtype=torch.float64, device=device)  # (mean return, mean length, stop)
            if is_main:
                eval_seed = args.seed + 10**9 + global_step  # seeds no training env uses
                video_name = f"eval-step{global_step}" if args.capture_video else None
                eval_returns, eval_lengths, video = evaluate(
                    q_network, eval_envs, args.eval_epsilon, eval_seed, device, video_name
                )
                stop = args.target_return is not None and eval_returns.mean() >= args.target_return
                result = torch.tensor(
                    [eval_returns.mean(), eval_lengths.mean(), float(stop)], dtype=torch.float64, device=device
                )
                writer.add_scalar("eval/episodic_return", eval_returns.mean(), global_step)
                writer.add_scalar("eval/episodic_length", eval_lengths.mean(), global_step)
                if video is not None:
                    log_video(writer, video, global_step, args.track)
            if world_size > 1:
                dist.broadcast(result, src=0)
            eval_return, _, stop = result.tolist()
            reached = stop > 0
            eval_seconds += time.time() - started

        if last or preempted or reached or steps_crossed(prev_step, global_step, args.checkpoint_every):
            all_rng = [None] * world_size
            if world_size > 1:
                dist.all_gather_object(all_rng, rng_states(device))
            else:
                all_rng = [rng_states(device)]
            error = None
            if is_main:
                writer.flush()  # the events up to this checkpoint reach the file first: a crash after it loses none
                ckpt_out = dict(
                    script=SCRIPT,
                    args=asdict(args),
                    sizes=sizes,
                    world_size=world_size,
                    iteration=iteration,
                    global_step=global_step,
                    num_updates=num_updates,
                    num_target_updates=num_target_updates,
                    q_network=q_network.state_dict(),
                    agent_kwargs=agent_kwargs,
                    target_network=target_network.state_dict(),
                    optimizer=optimizer.state_dict(),
                    rng=all_rng,
                    wandb_run_id=wandb_run_id,
                )
                try:
                    atomic_save(ckpt_out, os.path.join(run_dir, "checkpoint.pt"))
                except OSError as e:  # disk full, quota, file size limit, read-only: every rank stops
                    error = f"could not write {run_dir}/checkpoint.pt ({e.strerror}); the previous checkpoint is intact"
            if world_size > 1:
                box = [error]
                dist.broadcast_object_list(box, src=0)
                error = box[0]
            if error:
                raise RunError(error, EXIT_BAD_INPUT)
        if reached:
            if is_main:
                print(
                    f"\n{SCRIPT}: evaluation return {eval_return:.1f} reached --target-return {args.target_return} "
                    f"at global step {global_step}; checkpoint saved in {run_dir}",
                    flush=True,
                )
            break
        if preempted:
            if is_main:
                print(
                    f"\n{SCRIPT}: preempted by a signal at iteration {iteration} (global step {global_step}); "
                    f"checkpoint saved in {run_dir}; relaunch with --resume {run_dir} to continue",
                    file=sys.stderr,
                    flush=True,
                )
            exit_code = EXIT_PREEMPTED
            break

    envs.close()
    if eval_envs is not None:
        eval_envs.close()
    if is_main:
        writer.close()
        if args.track:
            import wandb

            wandb.finish(exit_code=exit_code)
    return exit_code


if __name__ == "__main__":
    exit_code = 1
    try:
        exit_code = main()
    except RunError as e:
        if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
            print(f"{SCRIPT}: error: {e}", file=sys.stderr, flush=True)
        elif not dist.is_initialized():
            # Every rank found the same bad input before the ranks met; let rank 0 (maybe still starting
            # up) print it first: torchrun stops the other ranks as soon as one exits.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(5)
        exit_code = e.code
    except Exception as e:
        # A failed collective: the other ranks cannot be told, so every surviving rank says it, in one line.
        reason = lost_rank_message(e)
        if reason is None:
            raise
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))
        print(
            f"{SCRIPT}: error: rank {rank} lost contact with the other ranks ({reason}): a rank died, stalled "
            "longer than --dist-timeout, or the network failed; relaunch to resume from the last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        exit_code = EXIT_LOST_RANK
    finally:
        if dist.is_initialized() and exit_code != EXIT_LOST_RANK:  # teardown could wait on the lost peers
            dist.destroy_process_group()
    # Leave without interpreter finalization: there, gloo's C++ threads can still call std::terminate
    # ("terminate called without an active exception", pytorch#179291) and turn a finished run, or the
    # one-line exit 4 of a lost rank, into SIGABRT. Logs and checkpoints are closed and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
