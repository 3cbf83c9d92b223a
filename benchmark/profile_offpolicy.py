"""Where one rank's off-policy env step (SAC or TD3) spends its time: env step, action choice, replay add and
sample, critic forward/backward, gradient all-reduce, optimizer step, actor (and temperature) update, target
update, bookkeeping.

    python -m benchmark.profile_offpolicy --script sac_continuous_action_multigpu.py --env-id HalfCheetah-v5
    python -m benchmark.profile_offpolicy --script td3_continuous_action_multigpu.py --env-id Pendulum-v1 --steps 200
    python -m benchmark.profile_offpolicy --cudagraphs ...   # each update one CUDA graph replay (CUDA only)
    python -m benchmark.profile_offpolicy --no-cudagraphs ...  # eager (without either: the script's default)
    # 2 ranks (gloo; the flat all-reduce between backward and step, timed as its own part):
    python -m torch.distributed.run --standalone --nproc_per_node=2 -m benchmark.profile_offpolicy --script ...

The loop is built from the script's own pieces (`make_env`, `Actor`, `TwinQ`, the update stages `critic_stages`,
`actor_stages` and SAC's `temperature_stages`, `soft_update`, `all_reduce_gradients_flat`) and the modules they use
(`replay.ReplayBuffer`, `graphs.Update`, `rt.to_device`, `rt.Episodes`), composed as its `main()` composes them,
with the script's default flags (one env per rank, batch 256, one update per step, the actor every 2nd) once updates
run. Each timer waits for the device before it reads (`sync`: torch.cuda.synchronize on CUDA, nothing on the CPU),
so a part's time holds its own kernels: the profiled loop is slower than the script on a GPU (no overlap of host
and device): read the split from here and the SPS from a real run. Eagerly each stage of an update is timed on its
own; with --cudagraphs each captured part (a whole update at world size 1) is timed under its first stage. Parts:

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


# the part each update stage is timed in, by its name in the script
STAGE_PARTS = dict(critic_backward="critic", critic_step="step", update_targets="target", actor_backward="actor")
STAGE_PARTS |= dict(actor_step="actor", temperature_backward="actor", temperature_step="actor")


def profile_steps(module_name: str, env_id: str, steps: int, warmup: int = 20, device=None, cudagraphs=None) -> dict:
    """Fill this rank's buffer with `local_batch_size` random steps, then run `warmup + steps` env steps with one
    update each (the script's defaults; `cudagraphs`: the script's default when None); returns the mean seconds per
    step of each part after warm-up, and the rate.
    In a process group (torchrun) the gradients are averaged with the flat all-reduce between the stages."""
    mod = importlib.import_module(module_name)
    sac = hasattr(mod, "temperature_stages")
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
    q_optimizer = torch.optim.Adam(qf.parameters(), lr=q_lr, fused=True, capturable=True)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=policy_lr, fused=True, capturable=True)
    log_alpha = torch.zeros(1, requires_grad=True, device=device)
    a_optimizer = torch.optim.Adam([log_alpha], lr=q_lr, fused=True, capturable=True)
    for p in [*qf.parameters(), *actor.parameters(), log_alpha]:
        p.grad = torch.zeros_like(p)
    alpha = log_alpha.detach().exp()
    # the updates and the action choice as the script's main() builds them (world size 1, or flat)
    if sac:
        critic = mod.critic_stages(qf, qf, qf_target, actor, q_optimizer, alpha, args, world_size, mod.critic_loss)

        def update_targets(_):
            mod.soft_update([qf], [qf_target], args.tau)

        critic = [*critic, update_targets]
        stages = mod.actor_stages(actor, actor, qf, actor_optimizer, alpha, args, world_size, mod.policy_loss)
        stages += mod.temperature_stages(
            actor, log_alpha, alpha, a_optimizer, world_size, -float(action_dim), mod.temperature_loss
        )
        act = graphs.graphed(lambda obs: actor(obs)[0], cudagraphs)
    else:
        critic = mod.critic_stages(qf, qf, qf_target, target_actor, q_optimizer, args, world_size, mod.critic_loss)
        stages = mod.actor_stages(
            actor, actor, qf, target_actor, qf_target, actor_optimizer, args, world_size, mod.policy_loss
        )
        act = graphs.graphed(lambda obs: mod.eval_action(actor, obs, False, None, args), cudagraphs)
    critic, stages = [s for s in critic if s is not None], [s for s in stages if s is not None]
    update_critics, update_actor = graphs.Update(cudagraphs, *critic), graphs.Update(cudagraphs, *stages)
    pieces = {update_critics: critic, update_actor: stages}  # eagerly: each stage timed on its own

    def timed_update(update, inputs) -> list:
        """Each stage (eagerly) or each captured part of `update`, timed in its part; the tensors they return."""
        outputs = []
        for piece in update.parts if cudagraphs else pieces[update]:
            first = getattr(piece, "__name__", "").split("+")[0]
            with timer(STAGE_PARTS.get(first, "all_reduce")):
                out = piece(inputs)
            outputs += [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return outputs

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
            (critic_stats,) = timed_update(update_critics, data)
            num_updates += 1
            with timer("bookkeeping"):
                sums += critic_stats.double()
            if num_updates % args.policy_frequency == 0:
                for _ in range(args.policy_frequency if sac else 1):
                    timed_update(update_actor, data["obs"])
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
