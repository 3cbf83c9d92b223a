"""What `batch` does with each whole-script run (tests/dist_worker.py): the script runs unchanged (runpy, as
`__main__`, `run_script`) in one of four modes. `observe` records from outside what every rank did: env seeds, env
steps, sampled actions, RNG streams, optimizer steps, parameters before the first update, final parameters and
optimizer state, the env step of every optimizer step, target networks (DQN) at the first update and at the end
and the env steps at which they were synced, files opened for writing. `diverge` does the same and nudges one
parameter on rank 1 after its second optimizer step, for `--sync-check-every` to catch. `pinned` records as
`observe` with the randomness taken out of the comparison (PPO, PQN; `pin_sampling_and_minibatches`): action noise
from a table indexed by (rollout step, global env), minibatches drawn from one shared permutation, so that world
size G with one env per rank and one process with G envs see the same data. `plain` runs the script with nothing
recorded."""

import copy
import hashlib
import os
import random
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from script_specs import SCRIPTS
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from unit_updates import flat_params


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def observe(outdir: Path, script_path: str, script_args: list, nudge_after_step: int = 0) -> None:
    """Run the script as `__main__` with recording wrappers around library calls; the script is not modified."""
    rank = int(os.environ.get("RANK", 0))
    rec = dict(
        env={k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")},
        reset_seeds=[],
        env_steps=0,
        actions=[],
        rng_at_first_step=None,
        optimizer_steps=0,
        update_env_steps=[],  # this rank's env steps so far, at each optimizer step
        params_before_first_update=None,
        targets_before_first_update=None,  # target networks (spec.target_classes, held by no optimizer)
        online_before_first_update=None,  # the optimised network of the same class as each target, at that moment
        target_sync_env_steps=[],  # this rank's env steps so far, when a target network was found changed
        files_written=[],
        summary_writers=[],
        dist_rank=None,
        exit_code=None,
        episodes=[],  # (this rank's env steps so far, return, length) of each finished episode (gymnasium envs)
        loss_entropies=[],  # (this rank's env steps so far, mean entropy) of each loss forward of the Agent (PPO)
    )
    optimizers = []
    spec = SCRIPTS[Path(script_path).name]
    import gc

    def networks_and_optimizers():
        return [o for o in gc.get_objects() if issubclass(type(o), (torch.optim.Optimizer, torch.nn.Module))]

    earlier = {id(o) for o in networks_and_optimizers()}  # an earlier run's, kept alive (`LEFT_BY_RUNS`)
    networks = []  # the optimised networks of spec.target_classes, found at the first optimizer step
    targets = []  # the networks of those classes whose parameters no optimizer holds
    target_versions = []

    from torch.nn.modules.module import register_module_forward_hook

    def record_loss_entropy(module, inputs, output):
        if type(module).__name__ == "Agent" and len(inputs) == 2:  # forward(x, action): the loss, not the rollout
            rec["loss_entropies"].append((rec["env_steps"], float(output[2].float().mean())))

    undo = [register_module_forward_hook(record_loss_entropy).remove]  # each patch's removal, for the next run

    def target_version():
        return sum(p._version for t in targets for p in t.parameters())  # in-place copies raise it

    def note_target_sync():
        if targets and target_version() != target_versions[-1]:
            target_versions.append(target_version())
            rec["target_sync_env_steps"].append(rec["env_steps"])

    def wrap_vector_env(cls):
        reset, step = cls.reset, cls.step

        def recording_reset(self, *a, seed=None, **kw):
            seeds = [seed + i for i in range(self.num_envs)] if isinstance(seed, int) else seed
            rec["reset_seeds"].append(None if seeds is None else [int(s) for s in seeds])
            return reset(self, *a, seed=seed, **kw)

        def record_actions(self, actions):
            if rec["rng_at_first_step"] is None:
                import torch.distributed as dist

                rec["dist_rank"] = dist.get_rank() if dist.is_initialized() else None
                rec["rng_at_first_step"] = dict(
                    torch=digest(torch.get_rng_state().numpy()),
                    numpy=digest(np.random.get_state()[1]),
                    python=digest(np.array(random.getstate()[1])),
                )
            note_target_sync()  # a sync in the previous iteration
            rec["env_steps"] += self.num_envs
            if len(rec["actions"]) < 256:
                rec["actions"] += np.asarray(actions).reshape(self.num_envs, -1).tolist()

        def recording_step(self, actions):
            record_actions(self, actions)
            result = step(self, actions)
            if isinstance(self, gym.vector.SyncVectorEnv):  # episode = terminated or truncated (not Atari's games)
                running = self.__dict__.setdefault("_recorded", [np.zeros(self.num_envs), np.zeros(self.num_envs)])
                running[0] += result[1]
                running[1] += 1
                for i in np.flatnonzero(np.logical_or(result[2], result[3])):
                    rec["episodes"].append((rec["env_steps"], float(running[0][i]), int(running[1][i])))
                    running[0][i] = running[1][i] = 0
            return result

        originals = dict(cls.__dict__)
        cls.reset, cls.step = recording_reset, recording_step
        if hasattr(cls, "send") and hasattr(cls, "recv"):  # ALE's vector env: `step` is send + recv, and the
            send = cls.send  # asynchronous variant calls send and recv itself; record at send, once either way

            def recording_send(self, actions):
                record_actions(self, actions)
                return send(self, actions)

            cls.step, cls.send = step, recording_send

        def restore():
            for name in ("reset", "step", "send"):
                if name in originals:
                    setattr(cls, name, originals[name])
                elif name in cls.__dict__:
                    delattr(cls, name)

        undo.append(restore)

    vector_envs = [gym.vector.SyncVectorEnv, gym.vector.AsyncVectorEnv]
    try:
        from ale_py.vector_env import AtariVectorEnv

        vector_envs.append(AtariVectorEnv)
    except ImportError:
        pass
    for cls in vector_envs:
        wrap_vector_env(cls)

    def before_step(optimizer, a, kw):
        if optimizer not in optimizers:
            optimizers.append(optimizer)
        if rec["params_before_first_update"] is None:
            rec["params_before_first_update"] = flat_params(p for g in optimizer.param_groups for p in g["params"])
            # every optimizer and network the script made (the other optimizers have not stepped yet)
            found = [o for o in networks_and_optimizers() if id(o) not in earlier]
            every = [o for o in found if isinstance(o, torch.optim.Optimizer)]
            optimised = {id(p) for o in every for g in o.param_groups for p in g["params"]}
            for name in spec.target_classes:  # one target per class, in the order of spec.target_classes
                of_class = [m for m in found if type(m).__name__ == name]
                targets.extend(m for m in of_class if not any(id(p) in optimised for p in m.parameters()))
                networks.extend(m for m in of_class if any(id(p) in optimised for p in m.parameters()))
            rec["targets_before_first_update"] = [flat_params(t.parameters()) for t in targets]
            online = [next(m for m in networks if type(m) is type(t)) for t in targets]
            rec["online_before_first_update"] = [flat_params(m.parameters()) for m in online]
            target_versions.append(target_version())

    def after_step(optimizer, a, kw):
        rec["optimizer_steps"] += 1
        rec["update_env_steps"].append(rec["env_steps"])
        if nudge_after_step and rank == 1 and rec["optimizer_steps"] == nudge_after_step:
            with torch.no_grad():
                p = optimizer.param_groups[0]["params"][0]
                p[(0,) * p.dim()] += 1e-3

    undo += [register_optimizer_step_pre_hook(before_step).remove, register_optimizer_step_post_hook(after_step).remove]

    import builtins

    def recording_open(file, mode="r", *a, **kw):
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
            rec["files_written"].append(os.path.abspath(file))
        return builtin_open(file, mode, *a, **kw)

    def recording_replace(src, dst, *a, **kw):
        rec["files_written"].append(os.path.abspath(dst))
        return os_replace(src, dst, *a, **kw)

    builtin_open, os_replace = builtins.open, os.replace
    builtins.open, os.replace = recording_open, recording_replace
    from torch.utils.tensorboard import SummaryWriter

    writer_init = SummaryWriter.__init__

    def recording_writer_init(self, log_dir=None, *a, **kw):
        rec["summary_writers"].append(str(log_dir))
        writer_init(self, log_dir, *a, **kw)

    SummaryWriter.__init__ = recording_writer_init
    undo.append(lambda: setattr(SummaryWriter, "__init__", writer_init))
    try:
        rec["exit_code"] = run_script(script_path, script_args)
    finally:
        for remove in undo:
            remove()
        if optimizers:
            opt = optimizers[0]
            rec["final_params"] = flat_params(p for g in opt.param_groups for p in g["params"])
            rec["final_optimizer"] = copy.deepcopy(opt.state_dict())
            # every optimizer (SAC: critics, actor, log_alpha), in the order of their first step
            rec["final_params_by_optimizer"] = [
                flat_params(p for g in o.param_groups for p in g["params"]) for o in optimizers
            ]
            rec["final_optimizers"] = [copy.deepcopy(o.state_dict()) for o in optimizers]
        note_target_sync()  # a sync in the last iteration
        rec["final_targets"] = [flat_params(t.parameters()) for t in targets]
        builtins.open, os.replace = builtin_open, os_replace
        outdir.mkdir(parents=True, exist_ok=True)
        torch.save(rec, outdir / f"rank{rank}.pt")
    return rec["exit_code"]


# What each run left (its SystemExit, whose traceback holds the run's objects), kept until the process leaves with
# os._exit: a gloo process group joins its threads in its destructor while holding the GIL, which one of them may be
# waiting for (seen: a DDP Reducer freed after a preempted SAC run hung rank 1); the scripts leave with os._exit
# for the same reason.
LEFT_BY_RUNS = []


def run_script(script_path: str, script_args: list) -> int:
    """Run the script as `__main__` with `script_args`, here; its exit code (it leaves with os._exit, which raises
    SystemExit meanwhile, so that the caller can record and go on)."""
    argv, exit_ = sys.argv, os._exit
    sys.argv, os._exit = [script_path, *map(str, script_args)], raise_system_exit
    try:
        runpy.run_path(script_path, run_name="__main__")
        return 0
    except SystemExit as e:
        LEFT_BY_RUNS.append(e)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv, os._exit = argv, exit_


def pin_sampling_and_minibatches(script_path: str, script_args: list, global_envs: int) -> Callable:
    """Make runs of G global envs draw the same numbers at every world size W (G / W envs per rank).

    Action noise: `Normal.rsample` (the continuous PPO's sampler) returns loc + scale * z, with z for (the call's
    index, the global env) from a table, whichever rank steps that env; so do PQN's exploration draws, `torch.rand`
    (explore or not) and `torch.randint` (the random action). Minibatches: `torch.randperm` returns, on every rank,
    the rows of one permutation P of the rollout's steps, minibatch k holding the rows P_k of every local env (row s
    of local env e is index s * G / W + e of the flattened batch), so that each global minibatch holds the same
    samples at every world size. Returns the function that puts the real ones back.
    """
    from torch.distributions.normal import Normal

    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    num_minibatches = int(script_args[script_args.index("--num-minibatches") + 1])
    local_envs = global_envs // world_size
    calls = {"sample": 0, "randperm": 0, "rand": 0, "randint": 0}
    randperm, rand, randint, rsample = torch.randperm, torch.rand, torch.randint, Normal.rsample

    def table_sample(self, sample_shape=torch.Size()):
        t, n = calls["sample"], self.loc.shape[0]
        calls["sample"] += 1
        z = [torch.randn(self.loc.shape[1:], generator=torch.Generator().manual_seed(1_000_003 * t + rank * n + i))
             for i in range(n)]  # fmt: skip
        with torch.no_grad():
            return self.loc + self.scale * torch.stack(z).to(self.loc.device)

    def shared_randperm(n, *a, device=None, **kw):
        generator = torch.Generator().manual_seed(calls["randperm"])
        calls["randperm"] += 1
        p = randperm(n // local_envs, generator=generator)
        parts = [q * local_envs + e for q in p.chunk(num_minibatches) for e in range(local_envs)]
        return torch.cat(parts).to(device)

    def table(name: str, draw):
        """A draw per local env, from a generator of (the call's index, the global env), as a tensor [local envs]."""
        t = calls[name]
        calls[name] += 1
        seeds = [1_000_003 * t + 7919 * len(name) + rank * local_envs + i for i in range(local_envs)]
        return torch.cat([draw(torch.Generator().manual_seed(seed)) for seed in seeds])

    def table_rand(size, *a, device=None, **kw):  # PQN: torch.rand(local envs)
        return table("rand", lambda g: rand(1, generator=g)).to(device)

    def table_randint(low, high, size, *a, device=None, **kw):  # PQN: torch.randint(0, actions, (local envs,))
        return table("randint", lambda g: randint(low, high, (1,), generator=g)).to(device)

    Normal.rsample, torch.randperm = table_sample, shared_randperm
    if SCRIPTS[Path(script_path).name].pqn:
        torch.rand, torch.randint = table_rand, table_randint

    def unpin():
        Normal.rsample, torch.randperm, torch.rand, torch.randint = rsample, randperm, rand, randint

    return unpin


def raise_system_exit(code):
    raise SystemExit(code)
