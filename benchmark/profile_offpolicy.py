"""Where one rank's off-policy env step (SAC or TD3) spends its time: env step, action choice, replay add and
sample, critic forward/backward, gradient all-reduce, optimizer step, actor (and temperature) update, target
update, bookkeeping.

    python -m benchmark.profile_offpolicy --script sac_continuous_action_multigpu.py --env-id HalfCheetah-v5
    python -m benchmark.profile_offpolicy --script td3_continuous_action_multigpu.py --env-id Pendulum-v1 --steps 200
    python -m benchmark.profile_offpolicy --cudagraphs ...   # each update one CUDA graph replay (CUDA only)
    python -m benchmark.profile_offpolicy --no-cudagraphs ...  # eager (without either: the script's default)
    # 2 ranks (gloo; the flat all-reduce between backward and step, timed as its own part):
    python -m torch.distributed.run --standalone --nproc_per_node=2 -m benchmark.profile_offpolicy --script ...

The loop is built from the script's own pieces (`make_env`, `Actor`, `TwinQ`, the losses, `soft_update`,
`all_reduce_gradients_flat`) and the modules they use (`replay.ReplayBuffer`, `graphs`, `rt.to_device`,
`rt.Episodes`), in the update functions of its `main()` and in their order, with the script's default flags (one env
per rank, batch 256, one update per step, the actor every 2nd) once updates run. Each timer waits for the device
before it reads (`sync`: torch.cuda.synchronize on CUDA, nothing on the CPU), so a part's time holds its own kernels:
the profiled loop is slower than the script on a GPU (no overlap of host and device): read the split from here and
the SPS from a real run. Eagerly each function of an update is timed on its own; with --cudagraphs at world size 1
a whole update is one graph, timed under its first part (the critics' step under "critic forward/backward"). Parts:

- env: `envs.step` (gymnasium's `SyncVectorEnv`, MuJoCo or classic control);
- action: the actor on the observation (copied to the device) and the actions back to the host;
- replay add / replay sample: `ReplayBuffer.add` (one copy to the device) and `.sample` (drawn on the device);
- critic forward/backward: `critic_backward` (the targets and both Q losses, `zero_grad`, `backward`);
- all-reduce: the flat all-reduces of the gradients between the stages (ranks only);
- critic optimizer step: `critic_step`, the critics' Adam step;
- actor update: after every `--policy-frequency`-th update, the actor's stages (SAC: `policy_frequency` times, with
  the temperature's): loss, backward and Adam step;
- target update: the Polyak update of the target networks (`soft_update`, one foreach lerp; TD3's after its actor);
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

from cleanrl_ddp import graphs, replay
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


def profile_steps(module_name: str, env_id: str, steps: int, warmup: int = 20, device=None, cudagraphs=None) -> dict:
    """Fill this rank's buffer with `local_batch_size` random steps, then run `warmup + steps` env steps with one
    update each (the script's defaults; `cudagraphs`: the script's default when None); returns the mean seconds per
    step of each part after warm-up, and the rate.
    In a process group (torchrun) the gradients are averaged with the flat all-reduce between the stages."""
    mod = importlib.import_module(module_name)
    sac = hasattr(mod, "temperature_loss")
    args = mod.Args(env_id=env_id, grad_sync="flat")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if device is None:
        device = torch.device("cuda", 0) if args.cuda and torch.cuda.is_available() else torch.device("cpu")
    cudagraphs = (getattr(args, "cudagraphs", False) if cudagraphs is None else cudagraphs) and device.type == "cuda"
    timer = Timer(torch.cuda.synchronize if device.type == "cuda" else lambda: None)
    rt.seed_everything(args.seed)
    envs = gym.vector.SyncVectorEnv([mod.make_env(env_id)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    action_dim = int(np.prod(envs.single_action_space.shape))
    low, high = envs.single_action_space.low, envs.single_action_space.high
    agent_kwargs = dict(obs_dim=obs_dim, action_dim=action_dim, action_low=low.tolist(), action_high=high.tolist())
    actor, target_actor = mod.Actor(**agent_kwargs).to(device), mod.Actor(**agent_kwargs).to(device)
    qf, qf_target = mod.TwinQ(obs_dim, action_dim).to(device), mod.TwinQ(obs_dim, action_dim).to(device)
    target_actor.load_state_dict(actor.state_dict())
    qf_target.load_state_dict(qf.state_dict())
    q_lr, policy_lr = (args.q_lr, args.policy_lr) if sac else (args.learning_rate, args.learning_rate)
    q_optimizer = graphs.optimizer(torch.optim.Adam, qf.parameters(), q_lr, device, fused=True)
    actor_optimizer = graphs.optimizer(torch.optim.Adam, actor.parameters(), policy_lr, device, fused=True)
    log_alpha = torch.zeros(1, requires_grad=True, device=device)
    a_optimizer = graphs.optimizer(torch.optim.Adam, [log_alpha], q_lr, device, fused=True)
    for p in [*qf.parameters(), *actor.parameters(), log_alpha]:
        p.grad = torch.zeros_like(p)
    alpha = log_alpha.detach().exp()

    # the script's update functions (world size 1, or flat), each as (part, function of the update's input)
    def all_reduce(params):
        return lambda _: mod.all_reduce_gradients_flat(list(params), world_size)

    def critic_backward(data):
        if sac:
            *values, qf1_loss, qf2_loss = mod.critic_loss(qf, qf_target, actor, **data, alpha=alpha, gamma=args.gamma)
        else:
            *values, qf1_loss, qf2_loss = mod.critic_loss(qf, qf_target, target_actor, **data, args=args)
        q_optimizer.zero_grad(set_to_none=False)
        (qf1_loss + qf2_loss).backward()
        return torch.stack((values[0].mean(), values[1].mean(), qf1_loss, qf2_loss)).detach()

    def actor_backward(obs):
        qf.requires_grad_(False)
        loss = mod.policy_loss(actor, qf, obs, alpha) if sac else mod.policy_loss(actor, qf, obs)
        qf.requires_grad_(True)
        actor_optimizer.zero_grad(set_to_none=False)
        loss.backward()

    def temperature_backward(obs):
        a_loss = mod.temperature_loss(actor, log_alpha, obs, -float(action_dim))
        a_optimizer.zero_grad(set_to_none=False)
        a_loss.backward()

    def temperature_step(_):
        a_optimizer.step()
        with torch.no_grad():
            alpha.copy_(log_alpha.exp())

    ranks = world_size > 1
    critic_parts = [("critic", critic_backward), *[("all_reduce", all_reduce(qf.parameters()))] * ranks]
    critic_parts += [("step", lambda _: q_optimizer.step())]
    actor_parts = [("actor", actor_backward), *[("all_reduce", all_reduce(actor.parameters()))] * ranks]
    actor_parts += [("actor", lambda _: actor_optimizer.step())]
    if sac:
        actor_parts += [("actor", temperature_backward), *[("all_reduce", all_reduce([log_alpha]))] * ranks]
        actor_parts += [("actor", temperature_step)]
        target_parts = [("target", lambda _: mod.soft_update([qf], [qf_target], args.tau))]
    else:
        actor_parts += [("target", lambda _: mod.soft_update([actor, qf], [target_actor, qf_target], args.tau))]
        target_parts = []
    if cudagraphs and world_size == 1:  # each update one graph, timed whole under its first part

        def whole(parts):
            def update(x):
                return [fn(x) for _, fn in parts][0]

            return [(parts[0][0], graphs.graphed(update, True))] if parts else []

        critic_parts, actor_parts, target_parts = whole(critic_parts), whole(actor_parts), whole(target_parts)

    def timed(parts, x):
        """The parts of one update in order, each timed in its part; the first one's output."""
        outputs = []
        for part, fn in parts:
            with timer(part):
                outputs.append(fn(x))
        return outputs[0] if outputs else None

    if sac:
        act = graphs.graphed(lambda obs: actor(obs)[0], cudagraphs)
    else:
        act = graphs.graphed(lambda obs: mod.eval_action(actor, obs, False, None, args), cudagraphs)

    rb = replay.ReplayBuffer(args.buffer_size // world_size, obs_dim, action_dim, device, seed=rank)
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
            critic_stats = timed(critic_parts, data)
            num_updates += 1
            with timer("bookkeeping"):
                sums += critic_stats.double()
            if num_updates % args.policy_frequency == 0:
                for _ in range(args.policy_frequency if sac else 1):
                    timed(actor_parts, data["obs"])
            timed(target_parts, None)
        totals.append(time.perf_counter() - start)
    envs.close()
    seconds = {part: s / steps for part, s in timer.seconds.items()}
    total = sum(totals) / steps
    seconds["other"] = max(0.0, total - sum(seconds.values()))
    threads = torch.get_num_threads()
    return dict(
        seconds=seconds, total=total, sps=1 / total, device=str(device), threads=threads, world_size=world_size
    ) | dict(cudagraphs=cudagraphs)


def line(script: str, env_id: str, profile: dict) -> str:
    """The split of one env step as one line: milliseconds and share of each part."""
    total, parts = profile["total"], profile["seconds"]
    split = ", ".join(f"{PART_NAMES[p]} {1000 * parts[p]:.2f} ms ({100 * parts[p] / total:.0f}%)" for p in PARTS)
    where = f"{profile['device']}, {profile['threads']} thread(s), world size {profile['world_size']}"
    where += ", --cudagraphs: each captured part under its first stage" if profile["cudagraphs"] else ""
    return f"one env step of {script} on {env_id} ({where}), timed part by part: {1000 * total:.2f} ms = {split}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.profile_offpolicy", description=__doc__.split("\n")[0])
    parser.add_argument("--script", default="sac_continuous_action_multigpu.py", help="a SAC or TD3 script")
    parser.add_argument("--env-id", default="HalfCheetah-v5")
    parser.add_argument("--steps", type=int, default=500, help="profiled env steps (one update each), after warm-up")
    parser.add_argument("--warmup", type=int, default=20, help="env steps with updates before the profiled ones")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when there is one")
    parser.add_argument(
        "--cudagraphs",
        action=argparse.BooleanOptionalAction,
        help="each update and the action as CUDA graphs (captured on CUDA only; default: the script's)",
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0) if (args.device or "cuda") == "cuda" and torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    if "WORLD_SIZE" in os.environ:  # under torchrun: the ranks' flat all-reduce, through gloo
        dist.init_process_group("gloo")
    module = "cleanrl_ddp." + args.script.rsplit("/", 1)[-1].removesuffix(".py")
    profile = profile_steps(module, args.env_id, args.steps, args.warmup, device, args.cudagraphs)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("profile:", line(args.script.rsplit("/", 1)[-1], args.env_id, profile), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
