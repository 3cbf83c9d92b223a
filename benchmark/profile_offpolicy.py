"""Where one rank's off-policy env step (SAC or TD3) spends its time: env step, action choice, replay add and
sample, critic forward/backward, gradient all-reduce, optimizer step, actor (and temperature) update, target
update, bookkeeping.

    python -m benchmark.profile_offpolicy --script sac_continuous_action_multigpu.py --env-id HalfCheetah-v5
    python -m benchmark.profile_offpolicy --script td3_continuous_action_multigpu.py --env-id Pendulum-v1 --steps 200
    # 2 ranks (gloo; the flat all-reduce between backward and step, timed as its own part):
    python -m torch.distributed.run --standalone --nproc_per_node=2 -m benchmark.profile_offpolicy --script ...

The loop is built from the script's own pieces (`make_env`, `Actor`, `TwinQ`, `ReplayBuffer`, `critic_loss`,
`update_actor`, `all_reduce_gradients_flat`) and the modules they use (`rt.to_device`, `rt.Episodes`), in the order
its `main()` runs them once updates run, with the script's default flags (one env per rank, batch 256, one update
per step, the actor every 2nd). Each timer waits for the device before it reads (`sync`: torch.cuda.synchronize on
CUDA, nothing on the CPU), so a part's time holds its own kernels: the profiled loop is slower than the script on a
GPU (no overlap of host and device): read the split from here and the SPS from a real run. Parts:

- env: `envs.step` (gymnasium's `SyncVectorEnv`, MuJoCo or classic control);
- action: the actor on the observation (copied to the device) and the actions back to the host;
- replay add / replay sample: `ReplayBuffer.add` (one copy to the device) and `.sample` (drawn on the device);
- critic forward/backward: `critic_loss` (the targets and both Q losses), `zero_grad` and `backward`;
- all-reduce: the script's flat all-reduce of the critics' gradients (ranks only; DDP would hide it in backward);
- optimizer step: the critics' Adam step;
- actor update: the script's `update_actor` after every `--policy-frequency`-th update, whole (SAC: the actor and
  the temperature, `policy_frequency` times, with their all-reduces and steps; TD3: the actor, then its targets);
- target update: SAC's Polyak update of the target critics (TD3's is inside its `update_actor`);
- bookkeeping: episode statistics, the final observations, the loss sums;
- other: the rest of the step's wall time.
"""

import argparse
import importlib
import os
import time
from contextlib import contextmanager

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist

from cleanrl_ddp import runtime as rt

PARTS = ("env", "action", "add", "sample", "critic", "all_reduce", "step", "actor", "target", "bookkeeping", "other")
PART_NAMES = dict(env="env step", action="action choice", add="replay add", sample="replay sample")
PART_NAMES |= dict(critic="critic forward/backward", all_reduce="all-reduce", step="critic optimizer step")
PART_NAMES |= dict(actor="actor update", target="target update", bookkeeping="bookkeeping", other="other")


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


def profile_steps(module_name: str, env_id: str, steps: int, warmup: int = 20, device=None) -> dict:
    """Fill this rank's buffer with `local_batch_size` random steps, then run `warmup + steps` env steps with one
    update each (the script's defaults); returns the mean seconds per step of each part after warm-up, and the rate.
    In a process group (torchrun) the critics' and the actor's gradients are averaged with the flat all-reduce."""
    mod = importlib.import_module(module_name)
    sac = hasattr(mod, "temperature_loss")
    args = mod.Args(env_id=env_id, grad_sync="flat")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if device is None:
        device = torch.device("cuda", 0) if args.cuda and torch.cuda.is_available() else torch.device("cpu")
    timer = Timer(torch.cuda.synchronize if device.type == "cuda" else lambda: None)
    rt.seed_everything(args.seed)
    envs = gym.vector.SyncVectorEnv([mod.make_env(env_id)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    action_dim = int(np.prod(envs.single_action_space.shape))
    low, high = envs.single_action_space.low, envs.single_action_space.high
    actor = mod.Actor(obs_dim, action_dim, low.tolist(), high.tolist()).to(device)
    qf, qf_target = mod.TwinQ(obs_dim, action_dim).to(device), mod.TwinQ(obs_dim, action_dim).to(device)
    qf_target.load_state_dict(qf.state_dict())
    lr = args.q_lr if sac else args.learning_rate
    q_optimizer = torch.optim.Adam(qf.parameters(), lr=lr, fused=True)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=args.policy_lr if sac else lr, fused=True)
    log_alpha = torch.zeros(1, requires_grad=True, device=device)
    a_optimizer = torch.optim.Adam([log_alpha], lr=lr, fused=True)
    for p in [*qf.parameters(), *actor.parameters(), log_alpha]:
        p.grad = torch.zeros_like(p)
    alpha = log_alpha.detach().exp()
    target_actor = mod.Actor(obs_dim, action_dim, low.tolist(), high.tolist()).to(device)
    target_actor.load_state_dict(actor.state_dict())
    if sac:

        def act(obs):
            return actor(obs)[0]

        def critic_loss(data):
            return mod.critic_loss(qf, qf_target, actor, **data, alpha=alpha, gamma=args.gamma)

        def update_actor(obs):
            loss_fns = (mod.policy_loss, mod.temperature_loss)
            return mod.update_actor(
                obs, actor, actor, qf, actor_optimizer, log_alpha, alpha, a_optimizer, args, world_size,
                -float(action_dim), *loss_fns,
            )  # fmt: skip

    else:

        def act(obs):
            actions = actor(obs)
            return actions + torch.randn(actions.shape, device=device) * actor.action_scale * args.exploration_noise

        def critic_loss(data):
            return mod.critic_loss(qf, qf_target, target_actor, **data, args=args)

        def update_actor(obs):
            return mod.update_actor(
                obs, actor, actor, qf, target_actor, qf_target, actor_optimizer, args, world_size, mod.policy_loss
            )

    rb = mod.ReplayBuffer(args.buffer_size // world_size, obs_dim, action_dim, device, seed=rank)
    episodes = rt.Episodes(1)
    obs, _ = envs.reset(seed=args.seed + rank)
    sums, num_updates, totals = torch.zeros(4, dtype=torch.float64, device=device), 0, []
    for step in range(args.local_batch_size + warmup + steps):
        learning = step >= args.local_batch_size  # a buffer of one batch first, random actions
        if step == args.local_batch_size + warmup:  # from here on, the steady state
            timer.seconds, totals = dict.fromkeys(PARTS, 0.0), []
        start = time.perf_counter()
        with timer("action"), torch.no_grad():
            if learning:
                actions = act(rt.to_device(obs, device, dtype=torch.float32)).cpu().numpy().clip(low, high)
            else:
                actions = np.random.uniform(low, high, (1, action_dim)).astype(np.float32)
        with timer("env"):
            next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        with timer("bookkeeping"):
            done = terminations | truncations
            episodes.step(rewards, done)
            real_next_obs = next_obs.copy()
            if done.any():
                real_next_obs[done] = np.stack(infos["final_obs"][done])
        with timer("add"):
            rb.add(obs, real_next_obs, actions, rewards, terminations)
        obs = next_obs
        if learning:
            with timer("sample"):
                data = rb.sample(args.local_batch_size)
            with timer("critic"):
                qf1_a_values, qf2_a_values, qf1_loss, qf2_loss = critic_loss(data)
                q_optimizer.zero_grad(set_to_none=False)
                (qf1_loss + qf2_loss).backward()
            with timer("all_reduce"):
                mod.all_reduce_gradients_flat(list(qf.parameters()), world_size)
            with timer("step"):
                q_optimizer.step()
            num_updates += 1
            with timer("bookkeeping"):
                sums += torch.stack((qf1_a_values.mean(), qf2_a_values.mean(), qf1_loss, qf2_loss)).detach().double()
            if num_updates % args.policy_frequency == 0:
                with timer("actor"):
                    for _ in range(args.policy_frequency if sac else 1):
                        update_actor(data["obs"])
            if sac:
                with timer("target"), torch.no_grad():
                    for param, target_param in zip(qf.parameters(), qf_target.parameters(), strict=True):
                        target_param.lerp_(param, args.tau)
        totals.append(time.perf_counter() - start)
    envs.close()
    seconds = {part: s / steps for part, s in timer.seconds.items()}
    total = sum(totals) / steps
    seconds["other"] = max(0.0, total - sum(seconds.values()))
    threads = torch.get_num_threads()
    return dict(seconds=seconds, total=total, sps=1 / total, device=str(device), threads=threads, world_size=world_size)


def line(script: str, env_id: str, profile: dict) -> str:
    """The split of one env step as one line: milliseconds and share of each part."""
    total, parts = profile["total"], profile["seconds"]
    split = ", ".join(f"{PART_NAMES[p]} {1000 * parts[p]:.2f} ms ({100 * parts[p] / total:.0f}%)" for p in PARTS)
    where = f"{profile['device']}, {profile['threads']} thread(s), world size {profile['world_size']}"
    return f"one env step of {script} on {env_id} ({where}), timed part by part: {1000 * total:.2f} ms = {split}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.profile_offpolicy", description=__doc__.split("\n")[0])
    parser.add_argument("--script", default="sac_continuous_action_multigpu.py", help="a SAC or TD3 script")
    parser.add_argument("--env-id", default="HalfCheetah-v5")
    parser.add_argument("--steps", type=int, default=500, help="profiled env steps (one update each), after warm-up")
    parser.add_argument("--warmup", type=int, default=20, help="env steps with updates before the profiled ones")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when there is one")
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0) if (args.device or "cuda") == "cuda" and torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    if "WORLD_SIZE" in os.environ:  # under torchrun: the ranks' flat all-reduce, through gloo
        dist.init_process_group("gloo")
    module = "cleanrl_ddp." + args.script.rsplit("/", 1)[-1].removesuffix(".py")
    profile = profile_steps(module, args.env_id, args.steps, args.warmup, device)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("profile:", line(args.script.rsplit("/", 1)[-1], args.env_id, profile), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
