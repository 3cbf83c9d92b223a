"""Where one rank's PPO iteration spends its time: env step, policy step, host<->device copies, bookkeeping, update.

    # the split at 8 envs, next to the real run's SPS and the env-only ceiling of the same invocation
    python -m benchmark.throughput --world-sizes 1 --local-num-envs 8 --profile

The loop is built from the Atari PPO script's own pieces (`make_env`, `Agent`, `compute_gae`,
`normalize_advantages`, `ppo_loss`, and `halves` in the asynchronous variant) and the modules they use
(`graphs`, `atari.clip_reward`, `atari.game_over`), in the order its `main()` runs them, with a timer
around each part; with the script's `--cudagraphs` (`cudagraphs=True`, or the script's default) the policy
step, GAE and each minibatch update are CUDA graph replays on a GPU, as in the script. Each timer waits for the
device before it reads (`sync`: torch.cuda.synchronize on CUDA, nothing on CPU), so a part's time holds its own
kernels; that also removes the overlap of host and device work
that the real loop has, so on a GPU the profiled loop is slower than the script: read the split from here and
the SPS from the real run. Parts:

- env: the emulator, as the host sees it: `envs.step`, or `send` + `recv` where two halves overlap (there
  `recv` only waits for what the policy step of the other half did not hide);
- policy: the script's policy step: `get_action_and_value` on the rollout's frames (forward, sampling, log-prob,
  value) and its writes into the rollout buffers (actions, log-probs, values);
- copies: frames to the device (`graphs.fill`), actions to the host, rewards and dones once per rollout;
- bookkeeping: the frames' write into the rollout buffer, reward clipping, done flags (NumPy rows of the
  page-locked host buffers), whole-game accounting;
- update: the bootstrap value, GAE and every minibatch (loss, backward, clipping, optimizer step);
- other: the rest of the iteration's wall time (the loop's own Python).

One process, no process group: the update has no gradient all-reduce, and the rank runs alone.
"""

import ast
import importlib
import multiprocessing as mp
import os
import queue
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

from benchmark.harness import rank_threads
from cleanrl_ddp import atari, graphs

PARTS = ("env", "policy", "copies", "bookkeeping", "update", "other")
PART_NAMES = dict(env="env step", policy="policy step", copies="host<->device copies", bookkeeping="bookkeeping")
PART_NAMES |= dict(update="update", other="other")


class Timer:
    """Seconds per part; `sync` runs before each reading so that device work lands in the part that queued it."""

    def __init__(self, sync):
        self.sync, self.seconds = sync, dict.fromkeys(PARTS, 0.0)

    @contextmanager
    def __call__(self, part: str):
        start = time.perf_counter()
        yield
        self.sync()
        self.seconds[part] += time.perf_counter() - start


def profile_iterations(
    module_name: str, env_id: str, num_envs: int, num_steps: int, iterations: int, warmup: int = 1, cudagraphs=None
):
    """Run `warmup + iterations` PPO iterations of one rank of `module_name` (a cleanrl_ddp Atari PPO script)
    with its default flags (`cudagraphs`: the script's default when None); returns the mean seconds per
    iteration of each part after warm-up, the rate, and whether the policy step and the update were CUDA graph
    replays (`captured`: --cudagraphs on CUDA)."""
    module = importlib.import_module(module_name)
    args = module.Args(env_id=env_id, local_num_envs=num_envs, num_steps=num_steps)
    cudagraphs = getattr(args, "cudagraphs", False) if cudagraphs is None else cudagraphs
    sizes = module.derive_sizes(args, world_size=1)
    device = torch.device("cuda", 0) if args.cuda and torch.cuda.is_available() else torch.device("cpu")
    pin = device.type == "cuda"  # page-locked buffers and non-blocking copies, the script's `run.on_cuda`
    timer = Timer(torch.cuda.synchronize if pin else lambda: None)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # the script's envs: one vector env, or one per half in the asynchronous variant
    groups = module.halves(num_envs) if hasattr(module, "halves") else (slice(0, num_envs),)
    threads, sticky = torch.get_num_threads(), atari.sticky_action_probability(args)
    envs = [module.make_env(env_id, g.stop - g.start, min(threads, g.stop - g.start), sticky) for g in groups]
    seeds = np.arange(args.seed, args.seed + num_envs)
    resets = [e.reset(seed=seeds[g]) for e, g in zip(envs, groups, strict=True)]
    prev_lives = [info["lives"] for _, info in resets]
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # as the script
    agent = module.Agent(int(envs[0].single_action_space.n)).to(device, memory_format=memory_format)
    optimizer = graphs.optimizer(optim.Adam, agent.parameters(), args.learning_rate, device, eps=1e-5, fused=True)
    for p in agent.parameters():
        p.grad = torch.zeros_like(p)

    # the script's storage: allocated once, frames NHWC, host buffers page-locked on CUDA, static device inputs
    stack, height, width = envs[0].single_observation_space.shape
    obs = torch.zeros((num_steps, num_envs, height, width, stack), dtype=torch.uint8, device=device)
    actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
    logprobs = torch.zeros((num_steps, num_envs), device=device)
    values = torch.zeros((num_steps, num_envs), device=device)
    host_rewards = torch.zeros((num_steps, num_envs), pin_memory=pin)
    host_dones = torch.zeros((num_steps + 1, num_envs), pin_memory=pin)
    staging = [torch.zeros(frames.shape, dtype=torch.uint8, pin_memory=pin) for frames, _ in resets]
    next_obs = [s.to(device) for s in staging]
    for (frames, _), s, static in zip(resets, staging, next_obs, strict=True):
        graphs.fill(static, frames, s)
    rewards, all_dones = host_rewards.to(device), host_dones.to(device)
    rewards_np, dones_np, steps = host_rewards.numpy(), host_dones.numpy(), torch.arange(num_steps, device=device)

    def policy_step(step, k):
        with torch.no_grad():
            action, logprob, _, value = agent.get_action_and_value(next_obs[k])
        values[step, groups[k]], actions[step, groups[k]], logprobs[step, groups[k]] = value.flatten(), action, logprob

    capture = cudagraphs and device.type == "cuda"
    policy_steps = [graphs.graphed(partial(policy_step, k=k), capture) for k in range(len(groups))]
    update = updater(
        module, agent, optimizer, args, sizes, obs, actions, logprobs, values, rewards, all_dones, next_obs
    )
    update = [graphs.graphed(f, capture) for f in update]
    # GAE runs once an iteration: its capture, at its WARMUP-th call, falls in a warm-up iteration
    warmup = max(warmup, graphs.WARMUP) if capture else warmup

    k_groups, totals = len(groups), []
    for iteration in range(warmup + iterations):
        if iteration == warmup:  # from here on, the steady state
            timer.seconds = dict.fromkeys(PARTS, 0.0)
        start = time.perf_counter()
        with timer("bookkeeping"):
            dones_np[0] = dones_np[-1]
        # group k takes step `step` at turn k_groups * step + k; its results come in k_groups - 1 turns later
        # (at once with one group: the synchronous loop; one turn later with two halves: the overlapped one)
        for i in range(k_groups * num_steps + k_groups - 1):
            k, step = i % k_groups, i // k_groups
            if step < num_steps:
                with timer("bookkeeping"):
                    obs[step, groups[k]] = next_obs[k].permute(0, 2, 3, 1)
                with timer("policy"):
                    policy_steps[k](steps[step : step + 1])
                with timer("copies"):
                    host_action = actions[step, groups[k]].cpu().numpy()
                with timer("env"):
                    envs[k].send(host_action)
            if i >= k_groups - 1:
                k, step = (i - k_groups + 1) % k_groups, (i - k_groups + 1) // k_groups
                with timer("env"):
                    frames, reward, terminations, truncations, info = envs[k].recv()
                with timer("bookkeeping"):
                    dones_np[step + 1, groups[k]] = terminations | truncations
                    rewards_np[step, groups[k]] = atari.clip_reward(reward)
                    atari.game_over(terminations, truncations, info["lives"], prev_lives[k])
                    prev_lives[k] = info["lives"]
                with timer("copies"):
                    graphs.fill(next_obs[k], frames, staging[k])
        with timer("copies"):
            rewards.copy_(host_rewards, non_blocking=True)
            all_dones.copy_(host_dones, non_blocking=True)
        with timer("update"):
            run_update(module, update, args, sizes, device)
        totals.append(time.perf_counter() - start)
    for e in envs:
        e.close()

    seconds = {part: s / iterations for part, s in timer.seconds.items()}
    total = sum(totals[warmup:]) / iterations
    seconds["other"] = max(0.0, total - sum(seconds.values()))
    result = dict(seconds=seconds, total=total, sps=num_envs * num_steps / total, device=str(device), threads=threads)
    return result | dict(num_steps=num_steps, captured=capture)  # captured: the CUDA-graph path (on CUDA only)


def updater(module, agent, optimizer, args, sizes, obs, actions, logprobs, values, rewards, all_dones, next_obs):
    """The script's update at world size 1, as the functions it captures with --cudagraphs: (bootstrap value and
    GAE, one minibatch's loss, backward, clipping and optimizer step)."""
    b_obs = obs.reshape(-1, *obs.shape[2:]).permute(0, 3, 1, 2)  # NCHW view, channels-last strides
    batch = dict(mb_obs=b_obs, mb_actions=actions.reshape(-1), mb_logprobs=logprobs.reshape(-1))
    batch |= dict(mb_values=values.reshape(-1))

    def advantages_and_returns():
        with torch.no_grad():
            next_value = agent.get_value(torch.cat(next_obs)).reshape(1, -1)
            return module.compute_gae(
                rewards, values, all_dones[:-1], next_value, all_dones[-1], args.gamma, args.gae_lambda
            )

    def backward_and_step(mb_inds, mb_advantages, b_returns):
        minibatch = {k: b[mb_inds] for k, b in batch.items()}
        loss, stats = module.ppo_loss(agent, mb_advantages, **minibatch, mb_returns=b_returns[mb_inds], args=args)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()
        return stats

    return advantages_and_returns, backward_and_step


def run_update(module, update, args, sizes, device):
    """Bootstrap value, GAE, then every epoch's minibatches (`update`: `updater`'s functions)."""
    advantages_and_returns, backward_and_step = update
    advantages, returns = advantages_and_returns()
    b_advantages, b_returns = advantages.reshape(-1), returns.reshape(-1)
    for _epoch in range(args.update_epochs):
        b_inds = torch.randperm(sizes.local_batch_size, device=device).view(-1, sizes.local_minibatch_size)
        epoch_advantages = b_advantages[b_inds]
        if args.norm_adv:
            epoch_advantages = module.normalize_advantages(epoch_advantages, 1)
        for mb_inds, mb_advantages in zip(b_inds, epoch_advantages, strict=True):
            backward_and_step(mb_inds, mb_advantages, b_returns)


def profile_worker(module_name, env_id, num_envs, num_steps, iterations, threads, cores, results, cudagraphs=None):
    """`profile_iterations` in a process of its own, on `cores` with `threads` threads (one rank's share)."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    results.put(profile_iterations(module_name, env_id, num_envs, num_steps, iterations, cudagraphs=cudagraphs))


def is_profilable(script: str) -> bool:
    """Whether a script defines the pieces the profiled loop is built from (the Atari PPO scripts do). Read from
    its source, not imported: an outside baseline may train at import."""
    pieces = {"make_env", "Agent", "compute_gae", "ppo_loss", "normalize_advantages", "derive_sizes", "Args"}
    tree = ast.parse(Path(script).read_text())
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    return (
        pieces <= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} and "atari" in imported
    )


def profile_rank(
    script: str,
    env_id: str,
    world_size: int,
    num_envs: int,
    num_steps: int,
    iterations: int,
    cores=None,
    cudagraphs=None,
):
    """One rank of a run at `world_size`, profiled alone on its share of `cores` (default: this process's) in a
    process of its own, with the script's --cudagraphs when `cudagraphs` (None: its default); None when the script
    lacks the pieces (not an Atari PPO script)."""
    if not is_profilable(script):
        return None
    available = list(cores or sorted(os.sched_getaffinity(0)))
    threads = rank_threads(world_size, available)
    module_name = ".".join(Path(script).with_suffix("").parts)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    worker_args = (module_name, env_id, num_envs, num_steps, iterations, threads, available[:threads], results)
    worker_args += (cudagraphs,)
    proc = ctx.Process(target=profile_worker, args=worker_args)
    proc.start()
    while True:
        try:
            result = results.get(timeout=1.0)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the profile of {script} exited with code {proc.exitcode}") from None
    proc.join()
    return result


def markdown(rows: list[dict]) -> str:
    """One row per profiled configuration: the real run's SPS and the ceiling, then each part's seconds and share."""

    def part(row, name):
        seconds = row["seconds"][name]
        return f"{seconds:.3f} s ({100 * seconds / row['total']:.0f}%)"

    def number(x):
        return "" if np.isnan(x) else f"{x:,.0f}"

    lines = [
        "| world size | script | envs per rank | profiled rank | real run: global SPS | env-only ceiling "
        "| share of ceiling | profiled rank: SPS | " + " | ".join(PART_NAMES[p] for p in PARTS) + " |",
        "|---" * (8 + len(PARTS)) + "|",
    ]
    for r in rows:
        share = r["real_sps"] / r["ceiling"] if r["ceiling"] else np.nan
        lines.append(
            f"| {r['world_size']} | {r['script']} | {r['num_envs']} | {r['device']}, {r['threads']} thread(s) "
            f"| {number(r['real_sps'])} | {number(r['ceiling'])} | {'' if np.isnan(share) else f'{100 * share:.0f}%'} "
            f"| {r['sps']:,.0f} | " + " | ".join(part(r, p) for p in PARTS) + " |"
        )
    return "\n".join(lines)
