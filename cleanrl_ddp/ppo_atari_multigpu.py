"""PPO on Atari (Nature CNN), data-parallel with torch.distributed.

Docs: docs/ppo_atari_multigpu.md. Launch it any of these ways (all ranks run this same file):

    # 1 process (no process group)
    python cleanrl_ddp/ppo_atari_multigpu.py
    # 2 processes on one machine (2 ranks x 4 envs: CleanRL's 8 envs)
    torchrun --standalone --nproc_per_node=2 cleanrl_ddp/ppo_atari_multigpu.py --local-num-envs 4
    # 2 nodes x 8 GPUs: run on every node, with NODE_RANK 0 on the node at HOST
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \
        --master_addr=HOST --master_port=29500 cleanrl_ddp/ppo_atari_multigpu.py
    # SLURM: one task per process, MASTER_ADDR/MASTER_PORT exported (see benchmark/slurm/)
    srun --ntasks=16 --ntasks-per-node=8 python cleanrl_ddp/ppo_atari_multigpu.py

Every rank steps its own `--local-num-envs` games in ALE's C++ vector env; gradients are
averaged across ranks each minibatch (DDP, or one flattened all-reduce with `--grad-sync flat`),
so all ranks hold the same weights and together consume `--total-timesteps` agent steps.
"""

import io
import os
import random
import re
import signal
import sys
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import Literal, Optional

import ale_py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import tyro
from ale_py.vector_env import AtariVectorEnv
from torch.distributions.categorical import Categorical
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
    """agent steps of the whole run, summed over all ranks (x4 for emulator frames)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    local_num_envs: int = 4
    """the number of parallel environments on each rank"""
    num_steps: int = 128
    """the number of steps each environment runs per rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of minibatches per epoch (the same on every rank)"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """toggle advantage normalisation (statistics of the global minibatch, over all ranks)"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggle the clipped value loss"""
    ent_coef: float = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """the maximum norm for gradient clipping (of the averaged gradient)"""
    target_kl: Optional[float] = None
    """stop the epochs early when the KL averaged across ranks exceeds this"""

    # Evaluation (rank 0, in a separate env; flags and metric names as in ppo_multigpu.py)
    eval_every: int = 0
    """run evaluation games on rank 0 every N global steps (0 = never)"""
    eval_episodes: int = 10
    """whole games (all lives) per evaluation, one per env of rank 0's separate evaluation vector env"""
    eval_greedy: bool = False
    """if toggled, evaluation takes the likeliest action; default samples (greedy can stall a game: no FIRE)"""
    target_return: Optional[float] = None
    """stop every rank (after a checkpoint) once an evaluation's mean game score reaches this"""
    capture_video: bool = False
    """record each evaluation's first game to {run dir}/videos and TensorBoard/W&B (needs the video extra)"""

    # Speed
    precision: Literal["fp32", "bf16"] = "fp32"
    """`bf16`: the network under bfloat16 autocast (changes numerics); for GPUs and CPUs with AMX or AVX512-BF16"""
    channels_last: bool = True
    """store conv weights and activations channels-last (NHWC): faster convolutions, same math"""

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
    """every N iterations compare parameter and optimizer checksums across ranks (0 = off)"""

    # Fault tolerance
    checkpoint_every: int = 25
    """write checkpoint.pt every N iterations (0 = only at the end and on preemption)"""
    resume: Optional[str] = None
    """continue from a run directory or a checkpoint.pt file (its flags are the defaults; flags given here win)"""


def derive_sizes(args: Args, world_size: int) -> dict:
    """Global and per-rank sizes from the flags and the world size; raises ValueError on bad input."""
    for name in ("local_num_envs", "num_steps", "num_minibatches", "update_epochs", "total_timesteps", "eval_episodes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    local_batch_size = args.local_num_envs * args.num_steps
    if local_batch_size % args.num_minibatches != 0:
        raise ValueError(
            f"the local batch (--local-num-envs {args.local_num_envs} x --num-steps {args.num_steps} = "
            f"{local_batch_size}) does not divide into --num-minibatches {args.num_minibatches}"
        )
    batch_size = local_batch_size * world_size
    num_iterations = args.total_timesteps // batch_size
    if num_iterations < 1:
        raise ValueError(
            f"--total-timesteps {args.total_timesteps} is smaller than one iteration's global batch "
            f"({world_size} ranks x {args.local_num_envs} envs x {args.num_steps} steps = {batch_size})"
        )
    return dict(
        world_size=world_size,
        num_envs=args.local_num_envs * world_size,
        local_batch_size=local_batch_size,
        batch_size=batch_size,
        local_minibatch_size=local_batch_size // args.num_minibatches,
        minibatch_size=batch_size // args.num_minibatches,
        num_iterations=num_iterations,
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

    Life losses end an episode for learning (`terminated` is set; `life_loss_info`), but the game
    goes on; rewards come back unclipped so that the script can log whole-game scores (it clips them
    itself for learning). Autoreset happens within the same step, like gymnasium's SAME_STEP mode.
    """
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


def clip_reward(reward: np.ndarray) -> np.ndarray:
    """DeepMind reward clipping: the sign of the game reward (-1, 0, 1)."""
    return np.sign(reward).astype(np.float32)


def game_over(terminations, truncations, lives, prev_lives):
    """Which envs finished a whole game this step (not just lost a life).

    With life_loss_info every life loss sets `terminated`, but only a game over resets the game, and
    with same-step autoreset `info["lives"]` then already shows the new game's (full) lives.
    """
    return truncations | (terminations & (lives >= prev_lives))


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """The Nature-DQN CNN (Mnih et al., 2015) with a policy head and a value head."""

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
        # uint8 frames in, scaled here so that the rollout buffer stays uint8 (4x less memory and copying);
        # uint8 * float gives float32 in one pass, in the memory format of the frames
        if self.network[0].weight.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)  # a no-op for minibatches of the buffer
        else:
            x = x.contiguous()
        return self.network(x * (1.0 / 255.0))

    def get_value(self, x):
        return self.critic(self.hidden(x)).float()

    def get_action_and_value(self, x, action=None):
        hidden = self.hidden(x)
        # under bf16 autocast the layers run in bf16; the softmax, log-probs and losses run in float32
        logits = self.actor(hidden).float()
        probs = Categorical(logits=logits, validate_args=False)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden).float()

    def forward(self, x, action):
        # The loss goes through `forward` so that a DDP wrapper sees it and averages the gradients;
        # rollout inference calls `get_action_and_value` on the unwrapped agent (no DDP hooks).
        return self.get_action_and_value(x, action)


# ALGO LOGIC: pure functions, imported by the tests
def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """Generalised advantage estimation over a [num_steps, num_envs] rollout.

    `dones[t]` is 1 when `obs[t]` starts a new episode (CleanRL's convention), `next_done` likewise
    for the observation after the rollout. Returns (advantages, returns).
    """
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
    """Normalise with the mean and (unbiased) std of the *global* minibatch, all ranks together.

    One all-reduce of (sum, sum of squares, count) in float64, so that a 2-rank update equals the
    single-process update on the union of the two local minibatches.
    """
    a = adv.double()
    stats = torch.stack([a.sum(), (a * a).sum(), torch.tensor(float(a.numel()), dtype=a.dtype, device=a.device)])
    if world_size > 1:
        dist.all_reduce(stats)
    total, total_sq, n = stats.unbind()
    mean = total / n
    var = (total_sq - n * mean * mean) / (n - 1)
    return ((adv - mean.float()) / (var.clamp_min(0).sqrt().float() + 1e-8)).to(adv.dtype)


def ppo_loss(model, mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values, args: Args, world_size):
    """The clipped PPO loss of one local minibatch, and its stats (detached).

    `model` is the DDP-wrapped agent (or the plain agent with world size 1 or `--grad-sync flat`).
    """
    _, newlogprob, entropy, newvalue = model(mb_obs, mb_actions)
    logratio = newlogprob - mb_logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        # calculate approx_kl http://joschu.net/blog/kl-approx.html
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()

    if args.norm_adv:
        mb_advantages = normalize_advantages(mb_advantages, world_size)

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
    stats = torch.stack([pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac]).detach()
    return loss, stats


def evaluate(agent, eval_envs, greedy: bool, seed: int, device, video_name: Optional[str] = None):
    """Play one whole game (all lives) in each env of `eval_envs`; returns (returns, lengths, video). Rank 0 only.

    Returns are unclipped game scores, like `charts/episodic_return`. `greedy` takes the argmax action,
    otherwise actions are sampled from a generator of their own, so that evaluating never moves the
    training sampling stream. With `video_name` (and envs from `make_eval_envs(..., video_dir)`) env 0's
    game is written as {video_dir}/{video_name}.mp4, one frame per agent step (the newest 84x84 frame of
    each observation), and `video` is dict(path, frames [T, H, W, 3] uint8, fps); otherwise it is None.
    """
    episodes = eval_envs.num_envs
    generator = torch.Generator(device=device).manual_seed(seed)
    obs, info = eval_envs.reset(seed=np.arange(seed, seed + episodes, dtype=np.int64))
    prev_lives = info["lives"]
    frames = [obs[0, -1]] if video_name is not None else None  # the first frame, before any action
    returns, lengths = np.zeros(episodes), np.zeros(episodes, dtype=np.int64)
    running = np.ones(episodes, dtype=bool)
    while running.any():
        with torch.no_grad():
            logits = agent.actor(agent.hidden(torch.as_tensor(obs, device=device))).float()
            if greedy:
                action = logits.argmax(dim=1)
            else:
                action = torch.multinomial(logits.softmax(dim=1), 1, generator=generator).squeeze(1)
        obs, reward, terminations, truncations, info = eval_envs.step(action.cpu().numpy())
        over = game_over(terminations, truncations, info["lives"], prev_lives)
        prev_lives = info["lives"]
        returns += reward * running
        lengths += running
        if frames is not None and running[0] and not over[0]:  # at a game over, obs is the next game's (autoreset)
            frames.append(obs[0, -1])
        running &= ~over  # later games of a finished env are ignored
    if frames is None:
        return returns, lengths, None
    from moviepy.video.io.ImageSequenceClip import ImageSequenceClip

    fps = 15  # 60 emulator frames per second, 4 per agent step: real time
    rgb = np.repeat(np.stack(frames)[..., None], 3, axis=-1)  # grayscale -> [T, H, W, 3]
    os.makedirs(eval_envs.video_dir, exist_ok=True)
    path = os.path.join(eval_envs.video_dir, f"{video_name}.mp4")
    ImageSequenceClip(list(rgb), fps=fps).write_videofile(path, logger=None)
    return returns, lengths, dict(path=path, frames=rgb, fps=fps)


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


def steps_crossed(prev_step: int, global_step: int, every: int) -> int:
    """How many multiples of `every` lie in (prev_step, global_step]: the schedule of periodic events.

    The global step grows by the global batch per iteration, so a period that is not a multiple of it
    is still kept on average, and every rank computes the same answer from the same global step.
    """
    return global_step // every - prev_step // every if every > 0 else 0


def log_video(writer, video: dict, global_step: int, track: bool) -> None:
    """Attach an evaluation video (from `evaluate`) to TensorBoard and, with --track, to W&B. Rank 0 only."""
    frames = video["frames"][:: max(1, len(video["frames"]) // 200)]  # TensorBoard stores a GIF: keep it small
    fps = video["fps"] * len(frames) / len(video["frames"])
    writer.add_video("eval/video", frames.transpose(0, 3, 1, 2)[None], global_step, fps=max(1, round(fps)))
    if track:
        import wandb

        wandb.log({"eval/video": wandb.Video(video["path"], format="mp4")})


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
    missing = {"args", "world_size", "sizes", "iteration", "global_step", "agent", "optimizer", "rng"} - ckpt.keys()
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
    # Preemption: SIGTERM/SIGUSR1 only set a flag; all ranks stop together at the next iteration boundary.
    stop_signal = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))
    try:
        # with --resume the checkpoint's flags are merged in first; rank 0 derives the sizes then
        sizes = None if args.resume else derive_sizes(args, world_size)
        ale_game(args.env_id)
        if not 0.0 <= sticky_action_probability(args) <= 1.0:
            raise ValueError("--repeat-action-probability must be between 0 and 1")
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
    # Each rank gets its share of the cores it may run on (torchrun would otherwise leave 1), for torch's
    # threads and for the env's C++ threads (they alternate: the rollout waits for the env, then the net).
    num_threads = max(1, len(os.sched_getaffinity(0)) // local_world_size)
    torch.set_num_threads(num_threads)
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
            run_name = args.run_name or f"{args.env_id}__{args.exp_name}__{args.seed}__{launch_id()}"
            run_dir = os.path.join(args.runs_dir, run_name)
            resume_from = args.resume
            if resume_from is None and os.path.isfile(os.path.join(run_dir, "checkpoint.pt")):
                resume_from = run_dir  # an elastic restart or a requeued job: continue the same run
            ckpt = load_checkpoint(resume_from) if resume_from else None
            if ckpt is not None:
                if args.resume:  # continue writing into the directory of the checkpoint
                    run_dir = args.resume if os.path.isdir(args.resume) else os.path.dirname(args.resume) or "."
                # A resumed run takes the checkpoint's flags as its defaults (same schedule, seed, env);
                # flags given on this command line still win.
                saved = {k: v for k, v in ckpt["args"].items() if k in {f.name for f in fields(Args)}}
                args = tyro.cli(Args, default=Args(**saved))
                if args.env_id != saved["env_id"]:
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
        print(f"{SCRIPT}: {args.env_id}, run directory {run_dir}")
        for key, value in sizes.items():
            print(f"  {key:<22}{value}")
        dropped = args.total_timesteps - sizes["num_iterations"] * sizes["batch_size"]
        if dropped:
            print(f"  ({dropped} steps of --total-timesteps {args.total_timesteps} do not fill an iteration)")
        if ckpt:
            print(f"  resuming at iteration {start_iteration}, global step {global_step}")

    # CRUCIAL: every rank starts from the same weights, but steps its own envs with its own seeds and
    # samples actions from its own stream. Env seeds are global env indices (disjoint across ranks).
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    local_num_envs = args.local_num_envs
    envs = make_env(args.env_id, local_num_envs, min(num_threads, local_num_envs), sticky_action_probability(args))
    # what Agent's constructor needs, saved in checkpoints so that cleanrl_ddp/evaluate.py can rebuild it
    agent_kwargs = dict(n_actions=int(envs.single_action_space.n))
    agent = Agent(**agent_kwargs).to(device)
    if args.channels_last:
        agent = agent.to(memory_format=torch.channels_last)
    if world_size > 1:
        for tensor in agent.state_dict().values():  # identical start whichever --grad-sync is used
            dist.broadcast(tensor, src=0)
    # fused: one kernel for all parameters instead of a dozen passes over 1.7M of them (9x faster on CPU)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
    rank_seed = int(np.random.SeedSequence([args.seed, rank]).generate_state(1)[0])
    random.seed(rank_seed)
    np.random.seed(rank_seed)
    torch.manual_seed(rank_seed)
    if ckpt:
        agent.load_state_dict(ckpt["agent"])
        optimizer.load_state_dict(ckpt["optimizer"])
        set_rng_states(ckpt["rng"][rank], device)
    model = agent
    if world_size > 1 and args.grad_sync == "ddp":
        model = DDP(agent, device_ids=[device.index] if use_cuda else None)
    eval_envs = None
    if is_main and args.eval_every:
        video_dir = os.path.join(run_dir, "videos") if args.capture_video else None
        eval_envs = make_eval_envs(
            args.env_id, args.eval_episodes, video_dir, sticky_action_probability(args), num_threads
        )

    # A resumed run seeds its envs past the seeds earlier attempts used (env state is not checkpointed).
    env_seed0 = args.seed + rank * local_num_envs + (start_iteration - 1) * sizes["num_envs"]
    next_obs, info = envs.reset(seed=np.arange(env_seed0, env_seed0 + local_num_envs))
    prev_lives = info["lives"]

    # ALGO Logic: Storage setup. Frames stay uint8 (the network scales them), so a 128-step rollout of
    # 4 envs is 14 MB instead of 58 MB, stored height x width x stack (NHWC): a minibatch gathered from
    # the buffer is already channels-last. Rewards and dones live on the host and cross to the device
    # once per rollout, not once per step.
    stack, height, width = envs.single_observation_space.shape
    obs = torch.zeros((args.num_steps, local_num_envs, height, width, stack), dtype=torch.uint8, device=device)
    actions = torch.zeros((args.num_steps, local_num_envs), dtype=torch.long, device=device)
    logprobs = torch.zeros((args.num_steps, local_num_envs), device=device)
    values = torch.zeros((args.num_steps, local_num_envs), device=device)
    host_rewards = np.zeros((args.num_steps, local_num_envs), dtype=np.float32)
    host_dones = np.zeros((args.num_steps + 1, local_num_envs), dtype=np.float32)  # last row: next_done
    pin = use_cuda  # page-locked host memory lets the host-to-device copies run asynchronously
    host_rewards_t, host_dones_t = torch.from_numpy(host_rewards), torch.from_numpy(host_dones)
    if pin:
        host_rewards_t, host_dones_t = host_rewards_t.pin_memory(), host_dones_t.pin_memory()
        host_rewards, host_dones = host_rewards_t.numpy(), host_dones_t.numpy()
        obs_staging = torch.empty_like(obs[0], device="cpu").pin_memory()
    game_return = np.zeros(local_num_envs)  # unclipped score of the game in progress (all lives)
    game_length = np.zeros(local_num_envs, dtype=np.int64)
    recent_returns = deque(maxlen=100)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()

    def to_device(frames: np.ndarray) -> torch.Tensor:
        if not pin:
            return torch.from_numpy(frames)  # CPU: no copy at all
        obs_staging.numpy()[:] = frames
        return obs_staging.to(device, non_blocking=True)

    next_obs = to_device(next_obs)
    num_iterations = sizes["num_iterations"]
    eval_seconds = 0.0  # excluded from SPS
    sps_window = deque([(time.time(), global_step)], maxlen=11)
    show_live = is_main and sys.stdout.isatty()
    last_print = time.time()
    exit_code = 0
    for iteration in range(start_iteration, num_iterations + 1):
        rollout_start = time.perf_counter()
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        # sums of finished games' returns and lengths, and their count, over this iteration
        episode_stats = np.zeros(3)
        host_dones[0] = host_dones[-1]
        for step in range(args.num_steps):
            global_step += sizes["num_envs"]  # global: all ranks step at once
            obs[step] = next_obs.permute(0, 2, 3, 1)

            # ALGO LOGIC: action logic (unwrapped agent: inference must not go through DDP)
            with torch.no_grad(), autocast:
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob

            # TRY NOT TO MODIFY: execute the game and log data.
            frames, reward, terminations, truncations, info = envs.step(action.cpu().numpy())
            # A life loss ends the episode for learning (no bootstrapping through it, as in DeepMind's
            # protocol); only a game over ends the logged episode, whose return is the game's score.
            host_dones[step + 1] = terminations | truncations
            host_rewards[step] = clip_reward(reward)
            game_return += reward
            game_length += 1
            over = game_over(terminations, truncations, info["lives"], prev_lives)
            prev_lives = info["lives"]
            if over.any():
                episode_stats += (game_return[over].sum(), game_length[over].sum(), over.sum())
                game_return[over] = 0
                game_length[over] = 0
            next_obs = to_device(frames)

        rewards = host_rewards_t.to(device, non_blocking=pin)
        all_dones = host_dones_t.to(device, non_blocking=pin)
        dones, next_done = all_dones[:-1], all_dones[-1]
        # the update: GAE, then the epochs (timed, and the flat all-reduce within them, for perf/*)
        update_start = time.perf_counter()
        grad_sync_seconds = 0.0
        # bootstrap value if not done
        with torch.no_grad():
            with autocast:
                next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages, returns = compute_gae(
                rewards, values, dones, next_value, next_done, args.gamma, args.gae_lambda
            )

        # flatten the batch
        b_obs = obs.reshape(-1, height, width, stack).permute(0, 3, 1, 2)  # NCHW view, channels-last strides
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        # Optimizing the policy and value network. Every rank runs the same number of minibatches:
        # each minibatch's backward issues the same all-reduces everywhere.
        local_batch_size, local_minibatch_size = sizes["local_batch_size"], sizes["local_minibatch_size"]
        loss_stats = torch.zeros(6, device=device)
        num_updates = 0
        for _epoch in range(args.update_epochs):
            b_inds = torch.randperm(local_batch_size, device=device)
            for start in range(0, local_batch_size, local_minibatch_size):
                mb_inds = b_inds[start : start + local_minibatch_size]
                with autocast:
                    loss, mb_stats = ppo_loss(
                        model,
                        b_obs[mb_inds],
                        b_actions[mb_inds],
                        b_logprobs[mb_inds],
                        b_advantages[mb_inds],
                        b_returns[mb_inds],
                        b_values[mb_inds],
                        args,
                        world_size,
                    )
                optimizer.zero_grad(set_to_none=False)
                loss.backward()
                if world_size > 1 and args.grad_sync == "flat":
                    sync_start = time.perf_counter()
                    all_reduce_gradients_flat(list(agent.parameters()), world_size)
                    grad_sync_seconds += time.perf_counter() - sync_start
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
                loss_stats += mb_stats
                num_updates += 1

            if args.target_kl is not None:
                # CRUCIAL: decide from the KL averaged over ranks, so every rank stops after the same epoch
                kl = mb_stats[4].clone()
                if world_size > 1:
                    dist.all_reduce(kl)
                if kl.item() / world_size > args.target_kl:
                    break

        update_seconds = time.perf_counter() - update_start

        # One all-reduce per iteration carries every metric, plus the stop flag of any preempted rank.
        y_pred, y_true = b_values, b_returns
        metrics = torch.cat(
            [
                loss_stats / num_updates,
                torch.stack([y_true.sum(), (y_true**2).sum(), (y_true - y_pred).sum(), ((y_true - y_pred) ** 2).sum()]),
                torch.tensor([*episode_stats, float(bool(stop_signal))], device=device),
            ]
        ).double()
        if world_size > 1:
            dist.all_reduce(metrics)
        metrics = metrics.tolist()
        pg_loss, v_loss, entropy, old_approx_kl, approx_kl, clipfrac = (m / world_size for m in metrics[:6])
        n = sizes["batch_size"]
        var_y = metrics[7] / n - (metrics[6] / n) ** 2
        var_diff = metrics[9] / n - (metrics[8] / n) ** 2
        explained_var = np.nan if var_y == 0 else 1 - var_diff / var_y
        ep_return_sum, ep_length_sum, ep_count, stop_votes = metrics[10:14]
        preempted = stop_votes > 0
        last = iteration == num_iterations or preempted

        sps_window.append((time.time() - eval_seconds, global_step))
        sps = int((sps_window[-1][1] - sps_window[0][1]) / max(sps_window[-1][0] - sps_window[0][0], 1e-9))
        if is_main:
            # TRY NOT TO MODIFY: record rewards for plotting purposes
            writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
            if ep_count:
                writer.add_scalar("charts/episodic_return", ep_return_sum / ep_count, global_step)
                writer.add_scalar("charts/episodic_length", ep_length_sum / ep_count, global_step)
            writer.add_scalar("charts/episodes", ep_count, global_step)
            writer.add_scalar("losses/value_loss", v_loss, global_step)
            writer.add_scalar("losses/policy_loss", pg_loss, global_step)
            writer.add_scalar("losses/entropy", entropy, global_step)
            writer.add_scalar("losses/old_approx_kl", old_approx_kl, global_step)
            writer.add_scalar("losses/approx_kl", approx_kl, global_step)
            writer.add_scalar("losses/clipfrac", clipfrac, global_step)
            writer.add_scalar("losses/explained_variance", explained_var, global_step)
            writer.add_scalar("charts/updates_per_iteration", num_updates, global_step)
            writer.add_scalar("charts/SPS", sps, global_step)
            # rank 0's own wall time of this iteration's parts (waits for other ranks included)
            writer.add_scalar("perf/rollout_seconds", update_start - rollout_start, global_step)
            writer.add_scalar("perf/update_seconds", update_seconds, global_step)
            if world_size > 1 and args.grad_sync == "flat":
                writer.add_scalar("perf/grad_sync_seconds", grad_sync_seconds, global_step)
            if ep_count:
                recent_returns.append(ep_return_sum / ep_count)
            line = (
                f"iter {iteration}/{num_iterations}  step {global_step}  SPS {sps}  "
                f"return {np.mean(recent_returns) if recent_returns else float('nan'):.1f}"
            )
            if show_live:
                print("\r" + line, end="\n" if last else "", flush=True)
            elif time.time() - last_print > 60 or iteration % max(1, num_iterations // 10) == 0 or last:
                # not a terminal (a log file): a line a minute, at each tenth of the run, and at the end
                print(line, flush=True)
                last_print = time.time()

        if args.sync_check_every and iteration % args.sync_check_every == 0:
            try:
                check_replicas_in_sync(agent, optimizer, iteration, world_size)
            except RuntimeError as e:
                raise RunError(str(e), EXIT_DIVERGED)

        # Evaluation on rank 0; the result and the stop decision are broadcast, so all ranks stop together.
        # It runs after this iteration's perf/* timings were taken and is excluded from SPS.
        reached = False
        if steps_crossed(global_step - sizes["batch_size"], global_step, args.eval_every):
            started = time.time()
            result = torch.zeros(3, dtype=torch.float64, device=device)  # (mean return, mean length, stop)
            if is_main:
                eval_seed = args.seed + 10**9 + global_step  # seeds no training env uses
                video_name = f"eval-step{global_step}" if args.capture_video else None
                eval_returns, eval_lengths, video = evaluate(
                    agent, eval_envs, args.eval_greedy, eval_seed, device, video_name
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

        if last or reached or (args.checkpoint_every and iteration % args.checkpoint_every == 0):
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
                    agent=agent.state_dict(),
                    agent_kwargs=agent_kwargs,
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
                    f"at iteration {iteration} (global step {global_step}); checkpoint saved in {run_dir}",
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
