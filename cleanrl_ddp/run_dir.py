"""The run directory and restarts, which no script calls: the directory's name, the checkpoint a restart or
`--resume` continues from, that checkpoint's flags merged with the command line's, the checks that a resume can
continue, and claiming a new directory. Rank 0 runs them (`check_resumable` runs on every rank); `runtime.load_run`
and `runtime.open_run` call them and broadcast the outcome. docs/runtime.md#run-directory-and-resume describes it.
"""

import json
import os
from dataclasses import asdict, fields
from typing import Optional

import tyro

from cleanrl_ddp import checkpoint, launch, lease
from cleanrl_ddp.errors import RunError
from cleanrl_ddp.run import Run, RunArgs, misfit_flags

FLAGS_FILE = "flags.json"
"""written into a new run directory: the script and flags that made it, so that a restart recognises its own"""
NOT_FROM_CHECKPOINT = ("track", "wandb_project_name", "wandb_entity", "resume")
"""flags always taken from this command line, never from a checkpoint (a file someone else may have written)"""


def choose_run_dir(run: Run, args: RunArgs, required: tuple) -> tuple[str, RunArgs, Optional[dict], bool]:
    """Rank 0: (run directory, merged flags, checkpoint or None, whether the directory is new); raises RunError.

    A checkpoint is taken from `--resume`, or from the run directory itself when it holds one written with the
    same flags as this command line (an elastic restart or a requeued job replays its command); a run directory
    of other flags is refused. A resumed run takes the checkpoint's flags as its defaults (`take_saved_flags`).
    """
    run.launch_id = launch.launch_id()
    run_dir, new_dir, ckpt = name_run_dir(args), False, None
    if args.resume:  # continue writing into the directory of the checkpoint
        ckpt = checkpoint.load_checkpoint(args.resume, run.script, required)
        run_dir = args.resume if os.path.isdir(args.resume) else os.path.dirname(args.resume) or "."
    elif os.path.lexists(run_dir):  # a restart of this launch, or another run's directory
        ckpt = load_restart_checkpoint(run, args, run_dir, required)
    else:
        new_dir = True
    if ckpt is not None:
        args = take_saved_flags(run, args, ckpt, args.resume or run_dir)
    if os.path.isdir(run_dir) and (refusal := lease.take_or_refuse(run_dir, run.launch_id)):  # first
        raise RunError(refusal)
    return run_dir, args, ckpt, new_dir


def name_run_dir(args: RunArgs) -> str:
    """The run directory: `--run-name`, else `{UTC start}__{env_id}__{exp_name}__{seed}__{launch id}`."""
    run_name = args.run_name
    if run_name is None:
        run_name = launch.default_run_name(args.runs_dir, f"{args.env_id}__{args.exp_name}__{args.seed}")
    run_name = run_name.replace("/", "-")
    check_run_name(run_name)
    return os.path.join(args.runs_dir, run_name)


def check_run_name(run_name: str) -> None:
    """A run name is a plain directory name: not empty, not `.` or `..`, no leading dot."""
    if not run_name or run_name.startswith("."):
        raise RunError(f"--run-name must be a plain name (not empty, no leading dot, not . or ..), got {run_name!r}")


def load_restart_checkpoint(run: Run, args: RunArgs, run_dir: str, required: tuple) -> Optional[dict]:
    """The checkpoint in an existing `run_dir` (None before its first one), if this command's flags made the run:
    an elastic restart or a requeued job replays its command. A directory of other flags is refused."""
    if os.path.isfile(os.path.join(run_dir, "checkpoint.pt")):
        ckpt = checkpoint.load_checkpoint(run_dir, run.script, required)
        diffs = differing_flags(ckpt["args"], args, ckpt["sizes"], run.world_size)
    else:  # a restart before the first checkpoint, or not ours
        ckpt = None
        try:
            with open(os.path.join(run_dir, FLAGS_FILE)) as f:
                made_by = json.load(f)
            diffs = differing_flags(made_by["args"], args) if made_by["script"] == run.script else ["--script"]
        except (OSError, ValueError, KeyError, TypeError):
            diffs = ["(no flags.json: not made by this command)"]
    if diffs:
        raise RunError(
            f"{run_dir} belongs to a run with other flags: {'; '.join(diffs[:4])}; pass --resume {run_dir} "
            "to continue that run, or another --run-name for a new one (nothing was written)"
        )
    return ckpt


def differing_flags(saved: dict, args: RunArgs, sizes: Optional[dict] = None, world_size: int = 1) -> list:
    """The flags of this command line (`args`) whose values differ from a run's `saved` flags, as `--flag value`.

    `resume` is left out. A per-rank flag also matches the value that keeps the checkpoint's global `sizes` at
    this world size: an elastic restart or a requeue onto another task count replays the same command.
    """
    here, saved = json.loads(json.dumps(asdict(args))), json.loads(json.dumps(saved))
    local = per_rank_flags(saved, sizes, world_size) if sizes else {}
    diffs = []
    for name, value in here.items():
        if name == "resume" or name not in saved or value in (saved[name], local.get(name, saved[name])):
            continue
        diffs.append(f"--{name.replace('_', '-')} {value} (the run's: {saved[name]})")
    return diffs


def take_saved_flags(run: Run, args: RunArgs, ckpt: dict, source: str) -> RunArgs:
    """This command's flags over the checkpoint's: the checkpoint's are the defaults, flags given here win.

    Except: the env id and the global sizes stay the checkpoint's, and the `NOT_FROM_CHECKPOINT` flags come
    from this command line only. At another world size, the per-rank flags are derived again from the
    checkpoint's global sizes (`per_rank_flags`); the value the checkpoint was written with is accepted
    too, since torchrun and SLURM replay the same command.
    """
    saved = {k: v for k, v in ckpt["args"].items() if k in {f.name for f in fields(type(args))}}
    wrong = misfit_flags(saved, type(args))
    if wrong:
        raise RunError(f"--resume: {source} holds flags of another type: {', '.join(wrong)}; it was left as it is")
    checkpoint.check_saved_env_id(str(saved.get("env_id")), args.env_id, source)
    local = per_rank_flags(saved, ckpt["sizes"], run.world_size)
    cli, args = args, tyro.cli(type(args), default=type(args)(**(saved | local)))
    for name in NOT_FROM_CHECKPOINT:
        setattr(args, name, getattr(cli, name))
    if args.env_id != saved["env_id"]:
        raise RunError(f"--resume: {source} trained {saved['env_id']}, not --env-id {args.env_id}")
    for name, value in local.items():  # the saved value: a restart replaying its command line
        if getattr(args, name) not in (value, saved[name]):
            total = name.removeprefix("local_")
            raise RunError(
                f"--resume: --{name.replace('_', '-')} {getattr(args, name)} on {run.world_size} rank(s) "
                f"changes the checkpoint's {total} {ckpt['sizes'][total]}; omit it (each rank gets {value})"
            )
        setattr(args, name, value)
    return args


def per_rank_flags(saved_args: dict, sizes: dict, world_size: int) -> dict:
    """The per-rank flags that keep a checkpoint's global sizes at `world_size`: `local_X = X / world_size`.

    Every flag `local_X` whose global `X` the checkpoint's sizes hold is derived again: 8 envs saved
    as 2 ranks x `--local-num-envs 4` resume on 4 ranks as `--local-num-envs 2`. Raises RunError,
    naming the world sizes that would work, when a global size does not divide.
    """
    names = [name for name in saved_args if name.startswith("local_") and name.removeprefix("local_") in sizes]
    totals = {name: sizes[name.removeprefix("local_")] for name in names}
    if not totals:
        return {}
    fits = [w for w in range(1, min(totals.values()) + 1) if all(total % w == 0 for total in totals.values())]
    if world_size not in fits:
        what = " and ".join(f"{name.removeprefix('local_')} {total}" for name, total in totals.items())
        raise RunError(
            f"--resume: the checkpoint's {what} cannot be split evenly over {world_size} ranks; "
            f"relaunch with one of these world sizes: {', '.join(map(str, fits))}"
        )
    return {name: total // world_size for name, total in totals.items()}


def check_resumable(run: Run, sizes: dict, ckpt: Optional[dict]) -> None:
    """Refuse a resume that changes the global batch, or of a run that has finished its --total-timesteps."""
    if not ckpt:
        return
    # A resumed run keeps its global batch: its schedules depend on it (`load_run` already kept the env count;
    # another --num-steps would still change the batch).
    if ckpt["sizes"].get("batch_size") != sizes.get("batch_size"):
        saved = ckpt["sizes"].get("batch_size")
        raise RunError(
            f"--resume: the checkpoint's batch_size is {saved}, not {sizes.get('batch_size')}: keep its sizes"
        )
    if ckpt["iteration"] >= sizes.get("num_iterations", ckpt["iteration"] + 1):
        raise RunError(
            f"{run.run_dir} has finished: its checkpoint is at global step {ckpt['global_step']}, and "
            f"--total-timesteps {run.args.total_timesteps} asks for no more; to train on, pass --resume {run.run_dir} "
            "with a larger --total-timesteps (nothing was written)"
        )


def claim_run_dir(run: Run) -> Optional[str]:
    """Rank 0: create a new run directory exclusively and write its flags.json, or check that a restart's
    directory is writable; the reason it could not, else None. Called only once the checks passed: a run that
    fails them writes nothing."""
    try:
        if run.new_dir:  # claimed exclusively: never into a directory another run created
            os.makedirs(run.run_dir, exist_ok=True)  # (rank 0's evaluation recorder may have made it)
            error = lease.take_or_refuse(run.run_dir, run.launch_id)  # None, or the live run that holds it
            if error is None:
                with open(os.path.join(run.run_dir, FLAGS_FILE), "x") as f:
                    json.dump(dict(script=run.script, args=asdict(run.args)), f, indent=1)
            return error
        probe = os.path.join(run.run_dir, f".write-test.{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except FileExistsError:
        return f"another run created {run.run_dir} meanwhile: pass another --run-name (nothing was written)"
    except OSError as e:
        return f"cannot write to the run directory {run.run_dir}: {e.strerror}"
    return None
