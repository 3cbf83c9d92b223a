"""PPO on Atari (Nature CNN), data-parallel with torch.distributed.

Docs: docs/ppo_atari_multigpu.md. Launch it any of these ways (all ranks run this same file):

    python cleanrl_ddp/ppo_atari_multigpu.py                                    # 1 process
    torchrun --standalone --nproc_per_node=2 cleanrl_ddp/ppo_atari_multigpu.py  # 2 processes, one machine
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \\
        --master_addr=HOST --master_port=29500 cleanrl_ddp/ppo_atari_multigpu.py  # 2 nodes x 8 processes
    srun --ntasks=16 --ntasks-per-node=8 python cleanrl_ddp/ppo_atari_multigpu.py  # SLURM (see benchmark/slurm/)

Every rank steps its own `--local-num-envs` games in ALE's C++ vector env; gradients are averaged
across ranks each minibatch (DDP, or one flattened all-reduce with `--grad-sync flat`), so all ranks
hold the same weights and together consume `--total-timesteps` agent steps. Run plumbing (launch,
checkpoints, preemption, logging) lives in cleanrl_ddp/runtime.py.
"""

import os
import re
import time
from contextlib import nullcontext
from dataclasses import dataclass
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
    eval_episodes: int = 10
    """whole games (all lives) per evaluation, one per env of rank 0's separate evaluation vector env"""
    eval_greedy: bool = False
    """if toggled, evaluation takes the likeliest action; default samples (greedy can stall a game: no FIRE)"""
    precision: Literal["fp32", "bf16"] = "fp32"
    """`bf16`: the network under bfloat16 autocast (changes numerics); for GPUs and CPUs with AMX or AVX512-BF16"""
    channels_last: bool = True
    """store conv weights and activations channels-last (NHWC): faster convolutions, same math"""
    grad_sync: Literal["ddp", "flat"] = "ddp"
    """how gradients are averaged: DistributedDataParallel, or one all-reduce of all gradients flattened"""
    compile: bool = False
    """if toggled, `torch.compile` the minibatch loss and its backward (CUDA: with CUDA graphs, mode reduce-overhead)"""


def derive_sizes(args: Args, world_size: int) -> dict:
    """Global and per-rank sizes from the flags and the world size; raises RunError (a ValueError) on bad input."""
    for name in ("local_num_envs", "num_steps", "num_minibatches", "update_epochs", "total_timesteps"):
        if getattr(args, name) < 1:
            raise rt.RunError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
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


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """The Nature-DQN CNN (Mnih et al., 2015) with a policy head and a value head."""

    def __init__(self, n_actions: int):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
            nn.Flatten(), layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU(),
        )  # fmt: skip
        self.actor = layer_init(nn.Linear(512, n_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def hidden(self, x):
        # uint8 frames in, scaled here so that the rollout buffer stays uint8 (4x less memory and copying);
        # uint8 * float gives float32 in one pass, in the memory format of the frames
        channels_last = self.network[0].weight.is_contiguous(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        return self.network(x * (1.0 / 255.0))  # a no-op `contiguous` for minibatches of the NHWC buffer

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


def main() -> None:
    args = tyro.cli(Args)
    run = rt.start(args, SCRIPT, use_cuda=args.cuda and torch.cuda.is_available())
    args, ckpt = rt.resume(run, args, required=("agent", "optimizer", "agent_kwargs"))
    rank, world_size, device = run.rank, run.world_size, run.device
    ale_game(args.env_id)  # an unknown game: one line
    if not 0.0 <= sticky_action_probability(args) <= 1.0:
        raise rt.RunError("--repeat-action-probability must be between 0 and 1")
    sizes = derive_sizes(args, world_size)
    start_iteration = ckpt["iteration"] + 1 if ckpt else 1
    global_step = ckpt["global_step"] if ckpt else 0

    # CRUCIAL: every rank starts from the same weights, but steps its own envs with its own seeds and
    # samples actions from its own stream. Env seeds are global env indices (disjoint across ranks).
    rt.seed_everything(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    n = args.local_num_envs
    # the env's C++ threads get the rank's share of its cores, as torch's threads do (they alternate)
    envs = make_env(args.env_id, n, min(torch.get_num_threads(), n), sticky_action_probability(args))
    agent_kwargs = dict(n_actions=int(envs.single_action_space.n))  # saved for cleanrl_ddp/evaluate.py
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    agent = Agent(**agent_kwargs).to(device, memory_format=memory_format)
    if world_size > 1:
        for tensor in agent.state_dict().values():  # identical start whichever --grad-sync is used
            dist.broadcast(tensor, src=0)
    # fused: one kernel for all parameters instead of a dozen passes over 1.7M of them (9x faster on CPU)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
    rt.seed_everything(int(np.random.SeedSequence([args.seed, rank]).generate_state(1)[0]))
    if ckpt:
        agent.load_state_dict(ckpt["agent"])
        optimizer.load_state_dict(ckpt["optimizer"])
        rt.resume_rng(run, ckpt, args.seed)  # each rank's own streams; at another world size, new ones
    # gradients allocated once: backward accumulates into these same tensors, never into CUDA-graph memory (--compile)
    for p in agent.parameters():
        p.grad = torch.zeros_like(p)  # the parameter's memory format (channels-last), as DDP's buckets expect
    model = DDP(agent) if world_size > 1 and args.grad_sync == "ddp" else agent
    # --compile: ppo_loss and, through AOTAutograd, its backward; the all-reduce, clipping and step stay eager
    loss_fn = torch.compile(ppo_loss, mode="reduce-overhead" if run.pin else None) if args.compile else ppo_loss
    eval_envs = make_eval_envs(args, args.eval_episodes, rt.video_dir(run)) if run.is_main and args.eval_every else None
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()

    # A resumed run seeds its envs past the seeds earlier attempts used (env state is not checkpointed).
    env_seed0 = args.seed + rank * args.local_num_envs + (start_iteration - 1) * sizes["num_envs"]
    frames, info = envs.reset(seed=np.arange(env_seed0, env_seed0 + n))
    prev_lives = info["lives"]
    game_return, game_length = np.zeros(n), np.zeros(n, dtype=np.int64)  # the game in progress (all lives)

    # ALGO Logic: Storage setup. Frames stay uint8 (the network scales them), stored height x width x stack
    # (NHWC): a minibatch gathered from the buffer is already channels-last. Rewards and dones stay on the
    # host (page-locked on CUDA) and cross to the device once per rollout; frames cross each step through a
    # staging buffer of their own shape.
    stack, height, width = envs.single_observation_space.shape
    obs = torch.zeros((args.num_steps, n, height, width, stack), dtype=torch.uint8, device=device)
    actions = torch.zeros((args.num_steps, n), dtype=torch.long, device=device)
    logprobs = torch.zeros((args.num_steps, n), device=device)
    values = torch.zeros((args.num_steps, n), device=device)
    host_rewards = torch.zeros((args.num_steps, n), pin_memory=run.pin)
    host_dones = torch.zeros((args.num_steps + 1, n), pin_memory=run.pin)  # last row: next_done
    staging = staging_buffer(envs, run.pin)
    next_obs = to_device(frames, staging, device, run.pin)
    num_iterations, preempted = sizes["num_iterations"], False
    rt.open_run(run, sizes, ckpt)  # check the sizes, claim the run directory, TensorBoard (W&B); SPS clock starts

    for iteration in range(start_iteration, num_iterations + 1):
        rollout_start = time.perf_counter()
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        episodes = np.zeros(3)  # whole games ended this iteration: sum of scores, sum of lengths, count
        host_dones[0] = host_dones[-1]
        for step in range(args.num_steps):
            global_step += sizes["num_envs"]  # global: all ranks step at once
            obs[step] = next_obs.permute(0, 2, 3, 1)  # a copy: `staging` (next_obs on CPU) is reused below

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
            host_dones[step + 1] = torch.from_numpy(terminations | truncations)
            host_rewards[step] = torch.from_numpy(clip_reward(reward))
            game_return += reward
            game_length += 1
            over = game_over(terminations, truncations, info["lives"], prev_lives)
            prev_lives = info["lives"]
            episodes += (game_return[over].sum(), game_length[over].sum(), over.sum())
            game_return[over], game_length[over] = 0, 0
            next_obs = to_device(frames, staging, device, run.pin)

        rewards = host_rewards.to(device, non_blocking=run.pin)
        all_dones = host_dones.to(device, non_blocking=run.pin)
        dones, next_done = all_dones[:-1], all_dones[-1]
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
        batch = (b_obs, b_actions, b_logprobs, b_returns, b_values)  # ppo_loss's order, after the advantages

        # Optimizing the policy and value network. Every rank runs the same number of minibatches:
        # each minibatch's backward issues the same all-reduces everywhere.
        local_batch_size, local_minibatch_size = sizes["local_batch_size"], sizes["local_minibatch_size"]
        loss_sums, num_updates = {}, 0
        for _epoch in range(args.update_epochs):
            b_inds = torch.randperm(local_batch_size, device=device).view(-1, local_minibatch_size)  # row k: minibatch
            # CRUCIAL: minibatch k's advantages are normalised with the statistics of global minibatch k (row k of
            # every rank): one all-reduce for all the minibatches of the epoch
            epoch_advantages = b_advantages[b_inds]
            if args.norm_adv:
                epoch_advantages = normalize_advantages(epoch_advantages, world_size)
            for mb_inds, mb_advantages in zip(b_inds, epoch_advantages, strict=True):
                with autocast:
                    loss, mb_stats = loss_fn(model, mb_advantages, *(b[mb_inds] for b in batch), args)
                optimizer.zero_grad(set_to_none=False)
                loss.backward()
                if world_size > 1 and args.grad_sync == "flat":
                    sync_start = time.perf_counter()
                    all_reduce_gradients_flat(list(agent.parameters()), world_size)
                    grad_sync_seconds += time.perf_counter() - sync_start
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
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

        # Metrics of ALL ranks, by name in one all-reduce: losses averaged over ranks, whole games summed,
        # explained variance from the global batch's sums.
        y, d = b_returns, b_returns - b_values
        m = rt.all_sum(
            run,
            {f"losses/{k}": v / num_updates / world_size for k, v in loss_sums.items()}
            | dict(y=y.sum(), y2=(y * y).sum(), d=d.sum(), d2=(d * d).sum())
            | dict(ep_return=episodes[0], ep_length=episodes[1], ep_count=episodes[2]),
        )
        var_y = m.pop("y2") / sizes["batch_size"] - (m.pop("y") / sizes["batch_size"]) ** 2
        var_diff = m.pop("d2") / sizes["batch_size"] - (m.pop("d") / sizes["batch_size"]) ** 2
        perf = {"perf/rollout_seconds": update_start - rollout_start, "perf/update_seconds": update_seconds}
        if world_size > 1 and args.grad_sync == "flat":
            perf["perf/grad_sync_seconds"] = grad_sync_seconds
        scalars = {
            "charts/learning_rate": optimizer.param_groups[0]["lr"],
            "losses/explained_variance": np.nan if var_y == 0 else 1 - var_diff / var_y,
            "charts/updates_per_iteration": num_updates,
            **{k: v for k, v in m.items() if k.startswith("losses/")},
            **perf,  # rank 0's own wall time of this iteration's parts (waits for other ranks included)
        }
        rt.log(run, global_step, scalars, (m["ep_return"], m["ep_length"], m["ep_count"]))
        if args.sync_check_every and iteration % args.sync_check_every == 0:
            rt.check_replicas_in_sync(f"iteration {iteration}", world_size, agent, optimizer)

        # Evaluation on rank 0; the stop decision is broadcast, so all ranks stop together.
        reached = False
        if rt.steps_crossed(global_step - sizes["batch_size"], global_step, args.eval_every):
            with rt.off_the_clock(run):
                video = f"eval-step{global_step}" if args.capture_video else None
                seed = args.seed + 10**9 + global_step  # seeds no training env uses
                result = (
                    evaluate(agent, eval_envs, args, args.eval_greedy, seed, device, video) if run.is_main else None
                )
                reached = rt.log_evaluation(run, result, global_step)

        preempted = rt.preempted(run)  # a SIGTERM/SIGUSR1 on any rank stops every rank here
        last = iteration == num_iterations or preempted or reached
        if last or (args.checkpoint_every and iteration % args.checkpoint_every == 0):
            # no rank_state: ALE's C++ vector env cannot be pickled (a resumed run reseeds its envs, above)
            state = dict(agent=agent.state_dict(), agent_kwargs=agent_kwargs, optimizer=optimizer.state_dict())
            rt.save_checkpoint(run, iteration, global_step, None, **state)
        if preempted or reached:
            break

    rt.finish(run, global_step, preempted, envs, eval_envs)


# ALGO LOGIC: pure functions, imported by the tests
def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """Generalised advantage estimation over a [num_steps, num_envs] rollout; returns (advantages, returns).

    `dones[t]` is 1 when `obs[t]` starts a new episode (CleanRL's convention), `next_done` likewise
    for the observation after the rollout.
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
    """Normalise each row of `adv` [num_minibatches, local minibatch] (or one minibatch [local minibatch]) with
    the mean and (unbiased) std of that *global* minibatch: row k of every rank together.

    One all-reduce of (sum, sum of squares, count) per row in float64, for all the minibatches of an epoch at
    once, so that a 2-rank update equals the single-process update on the union of the two local minibatches.
    """
    a = adv.double()
    count = torch.full(a.shape[:-1], a.shape[-1], dtype=a.dtype, device=a.device)  # on the device: no host copy
    stats = torch.stack([a.sum(-1), (a * a).sum(-1), count])
    if world_size > 1:
        dist.all_reduce(stats)
    total, total_sq, n = stats.unbind()
    mean = total / n
    std = ((total_sq - n * mean * mean) / (n - 1)).clamp_min(0).sqrt()
    return ((adv - mean.float().unsqueeze(-1)) / (std.float().unsqueeze(-1) + 1e-8)).to(adv.dtype)


def ppo_loss(model, mb_advantages, mb_obs, mb_actions, mb_logprobs, mb_returns, mb_values, args: Args):
    """The clipped PPO loss of one local minibatch, and its named stats (detached).

    `mb_advantages` come normalised (`normalize_advantages`, once per epoch for all minibatches) when --norm-adv is
    on. `model` is the DDP-wrapped agent (or the plain agent with world size 1 or `--grad-sync flat`).
    """
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


def clip_reward(reward: np.ndarray) -> np.ndarray:
    """DeepMind reward clipping: the sign of the game reward (-1, 0, 1)."""
    return np.sign(reward).astype(np.float32)


def game_over(terminations, truncations, lives, prev_lives):
    """Which envs finished a whole game this step (not just lost a life).

    With life_loss_info every life loss sets `terminated`, but only a game over resets the game, and
    with same-step autoreset `info["lives"]` then already shows the new game's (full) lives.
    """
    return truncations | (terminations & (lives >= prev_lives))


# Frames to the device: through a pinned staging buffer on CUDA, the same lines on CPU
def staging_buffer(envs, pin: bool) -> torch.Tensor:
    """A host buffer shaped like the env's frames, [envs, 4, 84, 84] uint8 (NCHW, not the rollout buffer's
    NHWC rows), page-locked with `pin` so that `to_device` copies asynchronously."""
    return torch.empty((envs.num_envs, *envs.single_observation_space.shape), dtype=torch.uint8, pin_memory=pin)


def to_device(frames: np.ndarray, staging: torch.Tensor, device, non_blocking: bool) -> torch.Tensor:
    """The env's frames on `device`, through `staging`. On CPU the result IS `staging` (no second copy):
    it holds these frames until the next call. On CUDA the copy may still run when this returns; the
    rollout's `action.cpu()` waits for it before the next call overwrites `staging`."""
    staging.numpy()[:] = frames
    return staging.to(device, non_blocking=non_blocking)


# Evaluation on rank 0, in envs of its own: the interface every script offers (cleanrl_ddp/evaluate.py uses it)
def make_eval_envs(args: Args, num_envs: int, video_dir: Optional[str] = None) -> AtariVectorEnv:
    """Evaluation games: `make_env`'s preprocessing and the run's sticky actions, in a vector env of their own.

    ALE's vector env cannot render, so `evaluate` writes env 0's frames to {video_dir}/{video_name}.mp4 itself.
    """
    envs = make_env(args.env_id, num_envs, min(torch.get_num_threads(), num_envs), sticky_action_probability(args))
    envs.video_dir = video_dir  # where `evaluate` writes videos (None: it records none)
    return envs


def load_agent(ckpt: dict, device) -> Agent:
    agent = Agent(**ckpt["agent_kwargs"]).to(device)
    agent.load_state_dict(ckpt["agent"])
    return agent


def evaluate(agent, eval_envs, args: Args, greedy: bool, seed: int, device, video_name: Optional[str] = None):
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
    # 60 emulator frames per second, 4 per agent step: 15 frames per second is real time
    video = rt.write_video(frames, eval_envs.video_dir, video_name, fps=15) if frames is not None else None
    return returns, lengths, video


if __name__ == "__main__":
    with rt.exit_codes(SCRIPT):
        main()
