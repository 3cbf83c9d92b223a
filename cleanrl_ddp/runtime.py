"""Run plumbing shared by every cleanrl_ddp script: launch, run directory, checkpoints, resume,
preemption, replica checks, logging and exit codes. docs/runtime.md describes it.

Nothing here is about the algorithm. Plain functions and small dataclasses: a script calls them in one
line where the thing happens, and nothing here calls back into the script. The algorithm and every
data-parallel decision (sizes, seeds, the initial broadcast, DDP or the flat all-reduce, which
metrics are reduced) stay in the scripts.

Every script offers the same evaluation interface, which `cleanrl_ddp/evaluate.py` uses:
    make_eval_envs(args, num_envs, video_dir=None)  -> rank 0's separate evaluation envs
    load_agent(ckpt, device)                        -> the `agent` that `evaluate` takes
    evaluate(agent, eval_envs, args, greedy, seed, device, video_name=None) -> (returns, lengths, video)
"""

import io
import json
import os
import pickle
import random
import secrets
import signal
import sys
import time
import zipfile
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from typing import Any, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import tyro

from cleanrl_ddp import lease

EXIT_BAD_INPUT = 2
"""exit code: invalid flags, environment, checkpoint or run directory, or a full disk (nothing was overwritten)"""
EXIT_DIVERGED = 3
"""exit code: `--sync-check-every` found replicas whose parameters or optimizer state differ"""
EXIT_LOST_RANK = 4
"""exit code: a collective failed: another rank died, stalled past `--dist-timeout`, or the network broke"""
EXIT_PREEMPTED = 75
"""exit code: stopped by SIGTERM/SIGUSR1 after saving a checkpoint; relaunch to resume (EX_TEMPFAIL)"""
CHECKPOINT_KEYS = ("script", "args", "sizes", "world_size", "iteration", "global_step", "rng", "rank_state")
VERSIONED = ("torch", "gymnasium", "numpy", "mujoco", "ale-py")
"""the libraries whose versions a checkpoint records (a file that cannot be read is checked against them)"""
MAX_DIST_TIMEOUT = 365 * 86400
"""the longest --dist-timeout (a year): torch.distributed keeps its timeout in milliseconds"""
EXIT_INTERRUPTED = 130
"""exit code: a second Ctrl-C stopped the run at once, without a checkpoint (128 + SIGINT)"""


class RunError(ValueError):
    """An error the user can fix; printed as one line by rank 0, then exit with `code`."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.code = code


@dataclass
class RunArgs:
    """The flags of the run plumbing; every script's `Args` extends this with its algorithm's flags."""

    track: bool = False
    """if toggled, log to Weights and Biases (one run per job, from rank 0)"""
    wandb_project_name: str = "cleanrl_ddp"
    """the W&B project name"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team)"""
    runs_dir: str = "runs"
    """the directory that holds one sub-directory per run (TensorBoard events, checkpoint.pt, videos)"""
    run_name: Optional[str] = None
    """the run's directory name; default `{env_id}__{exp_name}__{seed}__{launch id}`, stable across restarts"""
    eval_every: int = 0
    """run evaluation episodes on rank 0 every N global steps (0 = never)"""
    eval_episodes: int = 10
    """episodes per evaluation, played in parallel in rank 0's separate evaluation envs"""
    target_return: Optional[float] = None
    """stop every rank (after a checkpoint) once an evaluation's mean return reaches this"""
    capture_video: bool = False
    """record each evaluation's first episode to {run dir}/videos and TensorBoard/W&B (needs the video extra)"""
    backend: Optional[Literal["nccl", "gloo"]] = None
    """the torch.distributed backend; default NCCL on CUDA, gloo on CPU (gloo also lets ranks share a GPU)"""
    dist_timeout: float = 300.0
    """seconds a collective may wait for a missing or stalled rank before the job fails"""
    share_gpus: bool = False
    """with NCCL, allow more ranks per node than visible GPUs (e.g. srun --gpus-per-task=1: each sees its own)"""
    sync_check_every: int = 0
    """every N iterations (DQN: global steps) compare parameter and optimizer checksums across ranks (0 = off)"""
    checkpoint_every: int = 25
    """write checkpoint.pt every N iterations (DQN: global steps); 0 = only at the end and when stopped"""
    resume: Optional[str] = None
    """continue from a run directory or a checkpoint.pt file (its flags are the defaults; flags given here win)"""
    trust_checkpoint: bool = False
    """load a checkpoint of the old pickled format: this RUNS ANY CODE the file carries; only for files you wrote"""


@dataclass
class Run:
    """Who this process is in the job, and the run's outputs. Made by `start`, filled in by `resume` and `open_logs`."""

    script: str
    args: Any
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: Optional[str]
    signals: list = field(default_factory=list)  # preemption signals received, appended by the handler
    run_dir: str = ""
    sizes: dict = field(default_factory=dict)
    writer: Any = None
    wandb_run_id: Optional[str] = None
    sps_window: deque = field(default_factory=lambda: deque(maxlen=11))
    paused_seconds: float = 0.0  # evaluation time, excluded from SPS
    recent_returns: deque = field(default_factory=lambda: deque(maxlen=100))
    last_print: float = 0.0
    last_line: str = ""  # the newest progress line, not yet printed to a log file
    new_dir: bool = False  # `open_logs` creates the run directory, exclusively (a new run, not a restart)
    launch: str = ""  # this launch's id (`launch_id`), set by `resume` on rank 0: the lease names it

    @property
    def is_main(self) -> bool:
        return self.rank == 0  # the GLOBAL rank: one writer per job, across nodes

    @property
    def pin(self) -> bool:
        """Page-locked host buffers and `non_blocking` copies: a value that differs by device, not a branch."""
        return self.device.type == "cuda"


# ---------------------------------------------------------------------------------------------- launch
def slurm_tasks_on_node(env) -> int:
    """The tasks of this srun step on this node. Plain `srun --ntasks=N` sets no SLURM_NTASKS_PER_NODE (only
    `--ntasks-per-node` does), so the step's layout is read: SLURM_STEP_TASKS_PER_NODE (or the job's
    SLURM_TASKS_PER_NODE), one entry per node in SLURM's compressed form "2(x3),1", at SLURM_NODEID."""
    layout = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not layout:
        return int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    per_node = []
    for entry in layout.split(","):
        count, _, repeat = entry.partition("(x")
        per_node += [int(count)] * int(repeat.rstrip(")") or 1)
    return per_node[int(env.get("SLURM_NODEID", 0))]


def read_launch_env() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's or SLURM's variables."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (or any env:// launcher)
        local_rank, local_world_size = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))
        return int(env["RANK"]), local_rank, int(env["WORLD_SIZE"]), local_world_size
    if int(env.get("SLURM_NTASKS", 1)) > 1:  # srun, one task per process
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in env:
                raise RunError(f"under srun, export {var} (e.g. the first host of the job and a free port)")
        rank, local_rank = int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0))
        return rank, local_rank, int(env["SLURM_NTASKS"]), slurm_tasks_on_node(env)
    return 0, 0, 1, 1


def launch_id() -> str:
    """An id that names this launch and survives torchrun elastic restarts and SLURM requeues.

    torchrun's run id; else the SLURM job and step (`slurm<JOB_ID>.<STEP_ID>`: the runs of one allocation
    differ by step, a requeued job counts its steps from 0 again); else a time stamp with a random suffix,
    so that two launches in the same second differ. Rank 0 calls it and broadcasts the run directory, so
    every rank of a launch agrees.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id not in ("", "none"):
        return run_id
    if "SLURM_JOB_ID" in os.environ:
        step = os.environ.get("SLURM_STEP_ID", "")
        return f"slurm{os.environ['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    return f"{int(time.time())}-{secrets.token_hex(3)}"


def torchrun_nnodes(agent_pid: Optional[int] = None) -> str:
    """The `--nnodes` of the torchrun agent (default: the parent) that started this worker ("" if unknown):
    torchrun does not tell its workers whether the job is elastic (`--nnodes=MIN:MAX`), so it is read from
    the agent's command line."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ""
    try:
        with open(f"/proc/{agent_pid or os.getppid()}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:  # not Linux: the --max-restarts checks still apply
        return ""
    for flag, value in zip(argv, argv[1:] + [""], strict=True):
        if flag == "--nnodes":
            return value
        if flag.startswith("--nnodes="):
            return flag.removeprefix("--nnodes=")
    return ""


def check_elastic_restarts(run_name: Optional[str]) -> None:
    """Refuse torchrun launches whose restarted workers could not continue the run: restarts after a failure
    (`--max-restarts`), and an elastic job's restarts when a node joins or leaves (`--nnodes=MIN:MAX`)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0
    elastic = ":" in torchrun_nnodes()
    if not (restarts or elastic):
        return
    what = "torchrun --nnodes=MIN:MAX" if elastic else "torchrun --max-restarts"
    # torchrun shares one TCPStore across restarts (torch >= 2.4, and always with the static rendezvous):
    # restarted workers read the previous attempt's addresses and fail to connect (pytorch#135712).
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RunError(
            f"{what} needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 exported and the c10d rendezvous "
            "(--standalone, or --rdzv-backend=c10d): otherwise restarted workers fail to connect (pytorch#135712)"
        )
    stable_id = os.environ.get("TORCHELASTIC_RUN_ID", "none") not in ("", "none") or "SLURM_JOB_ID" in os.environ
    if not stable_id and run_name is None:  # launch_id() would be a time stamp: a restart starts a new run
        raise RunError(f"{what} needs a run name that survives restarts: pass --rdzv-id=JOB_ID")


def check_run_flags(args: RunArgs) -> None:
    """Raise RunError for run flags that are out of range or that need another flag."""
    for name in ("checkpoint_every", "sync_check_every", "eval_every"):
        if getattr(args, name) < 0:
            raise RunError(f"--{name.replace('_', '-')} must be 0 (off) or positive")
    if args.eval_episodes < 1:
        raise RunError(f"--eval-episodes must be at least 1, got {args.eval_episodes}")
    if args.target_return is not None and not args.eval_every:
        raise RunError("--target-return needs --eval-every N (the evaluation decides the stop)")
    if args.capture_video and not args.eval_every:
        raise RunError("--capture-video needs --eval-every N (videos are of the evaluation episodes)")
    if args.capture_video:
        try:
            import moviepy  # noqa: F401 (gymnasium's RecordVideo and TensorBoard's add_video use it)
        except ImportError:
            raise RunError("--capture-video needs moviepy: pip install -e '.[video]'") from None
    if not 0 < args.dist_timeout <= MAX_DIST_TIMEOUT:  # inf overflows the process group's timeout
        raise RunError(
            f"--dist-timeout must be positive (seconds) and at most {MAX_DIST_TIMEOUT}, got {args.dist_timeout}"
        )


def choose_device(use_cuda: bool, backend: Optional[str], local_rank: int, local_world_size: int, share_gpus: bool):
    """(device, backend): the local rank's GPU when CUDA is used (gloo included), else the CPU."""
    if not use_cuda:
        if backend == "nccl":
            raise RunError("--backend nccl needs CUDA; use --backend gloo (or omit it) on CPU")
        return torch.device("cpu"), "gloo"
    backend = backend or "nccl"
    n_gpus = torch.cuda.device_count()
    if backend == "nccl" and local_world_size > n_gpus and not share_gpus:
        raise RunError(
            f"NCCL cannot put two ranks on one GPU ({local_world_size} ranks on this node, {n_gpus} GPU(s) visible): "
            "pass --backend gloo to share GPUs, or launch at most one process per GPU"
        )
    return torch.device("cuda", local_rank % n_gpus), backend


def interrupt(run: Run) -> None:
    """Ctrl-C (SIGINT): the first one is a preemption (a checkpoint at the end of the iteration, exit 75);
    a second one raises KeyboardInterrupt, which `exit_codes` turns into an immediate exit 130."""
    if signal.SIGINT in run.signals:
        raise KeyboardInterrupt
    run.signals.append(signal.SIGINT)
    if run.is_main:
        print(
            f"\n{run.script}: interrupted: stopping with a checkpoint after this iteration "
            "(Ctrl-C again to stop at once, losing the work since the last checkpoint)",
            file=sys.stderr,
            flush=True,
        )


def usable_cores(cgroup_file: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup") -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (`docker --cpus`,
    a Kubernetes CPU limit), which the affinity does not show."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open(cgroup_file) as f:  # "ID:CONTROLLERS:PATH" lines; cgroup v2 is "0::PATH"
            groups = dict(line.rstrip("\n").split(":", 2)[1:] for line in f)
    except (OSError, ValueError):
        return cores
    v1 = next((c for c in groups if "cpu" in c.split(",")), None)
    if v1 is not None:  # cgroup v1: cpu.cfs_quota_us (-1: no quota) and cpu.cfs_period_us
        root, files, path = f"{mount}/{v1}", ("cpu.cfs_quota_us", "cpu.cfs_period_us"), groups[v1]
    else:  # cgroup v2: cpu.max, "QUOTA PERIOD" or "max PERIOD"
        root, files, path = mount, ("cpu.max",), groups.get("", "/")
    while True:  # the tightest quota of the group and its parents (in a container, only "/" may be visible)
        try:
            quota, period = " ".join(open(f"{root}{path}/{name}").read() for name in files).split()[:2]
            if quota not in ("max", "-1"):
                cores = min(cores, max(1, -(-int(quota) // int(period))))  # a part of a core counts as one
        except (OSError, ValueError):
            pass
        if path in ("", "/"):
            return cores
        path = os.path.dirname(path.rstrip("/"))


def user_omp_threads(env, agent_pid: Optional[int] = None) -> Optional[int]:
    """OMP_NUM_THREADS if the user set it. torchrun sets it to 1 for its workers when the user did not: that
    one is recognised by its absence from the torchrun agent's (the parent's) start-up environment."""
    value = env.get("OMP_NUM_THREADS", "")
    if not value:
        return None
    if "TORCHELASTIC_RUN_ID" in env:
        try:
            with open(f"/proc/{agent_pid or os.getppid()}/environ", "rb") as f:
                if not any(v.startswith(b"OMP_NUM_THREADS=") for v in f.read().split(b"\0")):
                    return None  # torchrun's default, not the user's
        except OSError:  # not Linux: take it as the user's
            pass
    threads = value.split(",")[0]  # OpenMP's nested form "4,2": the outer level
    if not threads.isdigit() or int(threads) < 1:
        raise RunError(f"OMP_NUM_THREADS must be a positive integer, got {value!r}")
    return int(threads)


def threads_per_rank(env, local_world_size: int, cores: int) -> tuple[int, str]:
    """(torch threads for this rank, why): a user's OMP_NUM_THREADS; else, when srun bound this task to CPUs of
    its own (task/affinity sets SLURM_CPU_BIND_TYPE), all of them; else the usable cores shared by the node's ranks."""
    omp = user_omp_threads(env)
    if omp is not None:
        return omp, "OMP_NUM_THREADS"
    # torchrun's workers (LOCAL_WORLD_SIZE) inherit their agent's binding: one set for all of them
    if env.get("SLURM_CPU_BIND_TYPE", "none") not in ("", "none") and "LOCAL_WORLD_SIZE" not in env:
        return cores, f"srun bound it to {cores} core(s)"
    return max(1, cores // local_world_size), f"{cores} core(s) / {local_world_size} rank(s)"


def start(args: RunArgs, script: str, use_cuda: bool) -> Run:
    """Read the launcher, catch preemption signals, check the run flags, pick the device, join the process group."""
    rank, local_rank, world_size, local_world_size = read_launch_env()
    run = Run(script, args, rank, local_rank, world_size, local_world_size, torch.device("cpu"), None)
    # Preemption: SIGTERM/SIGUSR1 and a first Ctrl-C only record the signal; all ranks vote and stop together
    # (`preempted`). A second Ctrl-C stops at once.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: run.signals.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: interrupt(run))
    check_run_flags(args)
    check_elastic_restarts(args.run_name)
    run.device, run.backend = choose_device(use_cuda, args.backend, local_rank, local_world_size, args.share_gpus)
    if run.device.type == "cuda":
        torch.cuda.set_device(run.device)
    # Each rank gets its share of the cores it may run on (torchrun would otherwise leave 1).
    threads, why = threads_per_rank(os.environ, local_world_size, usable_cores())
    torch.set_num_threads(threads)
    if world_size > 1:
        timeout, device_id = timedelta(seconds=args.dist_timeout), run.device if run.backend == "nccl" else None
        dist.init_process_group(run.backend, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id)
    if run.is_main:
        backend = run.backend if world_size > 1 else "none (one process)"
        ranks = f"{world_size} rank(s) ({local_world_size} on this node)"
        threads = f"{threads} thread(s) per rank ({why})"
        print(f"{script}: {ranks}, device {run.device}, {threads}, backend {backend}", flush=True)
    return run


# ---------------------------------------------------------------------------------------------- checkpoints
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


def library_versions() -> dict:
    """The installed versions of the libraries a checkpoint depends on (None: not installed)."""
    from importlib import metadata

    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def read_checkpoint(path: str, trust: bool = False) -> dict:
    """`torch.load` a checkpoint as data only (tensors, numbers, strings, lists, dicts): loading never runs code.

    Raises RunError naming the likely cause: a damaged file (its zip archive is torn), the old pickled format
    (refused unless `trust`), or an intact file this torch cannot read (another version wrote it).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several error types for truncated, foreign or pickled files
        error = e
    try:
        with zipfile.ZipFile(path) as archive:
            intact = archive.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError):
        intact = False
    if not intact:
        raise RunError(f"{path} is truncated or corrupt (a damaged file: {type(error).__name__}); it was left as it is")
    if not (isinstance(error, pickle.UnpicklingError) and "Unsupported global" in str(error)):
        raise RunError(
            f"{path} is intact but torch {torch.__version__} cannot read it ({type(error).__name__}): most likely "
            "a version mismatch (written by another torch); it was left as it is"
        )
    if not trust:
        raise RunError(
            f"{path} holds pickled objects (the old checkpoint format), and loading them would run code the file "
            "carries: pass --trust-checkpoint to load it anyway, only if you wrote it yourself"
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)  # --trust-checkpoint: runs the file's code
    except Exception as e:
        raise RunError(
            f"{path} is intact but needs code this installation lacks ({type(e).__name__}: {str(e)[:80]}): a version "
            f"mismatch with the libraries that wrote it (now {library_versions()}); it was left as it is"
        ) from None
    if isinstance(ckpt, dict) and isinstance(ckpt.get("rank_state"), list):
        ckpt["rank_state"] = [None] * len(ckpt["rank_state"])  # pickled envs: start new episodes instead
    return ckpt


def load_checkpoint(path: str, script: str, required: tuple = (), trust: bool = False) -> dict:
    """Load and validate a checkpoint of `script` holding `required` state; raise RunError with the reason."""
    if os.path.isdir(path):
        path = os.path.join(path, "checkpoint.pt")
    if not os.path.isfile(path):
        raise RunError(f"--resume: no checkpoint at {path}")
    try:
        ckpt = read_checkpoint(path, trust)
    except RunError as e:
        raise RunError(f"--resume: {e}") from None
    if not isinstance(ckpt, dict) or ckpt.get("script") != script:
        found = ckpt.get("script") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise RunError(f"--resume: {path} was written by {found!r}, not {script}")
    missing = set(CHECKPOINT_KEYS + tuple(required)) - ckpt.keys()
    if missing:
        raise RunError(f"--resume: {path} lacks {', '.join(sorted(missing))}; it was left as it is")
    return ckpt


def check_saved_env_id(saved: str, given: str, source: str) -> None:
    """A checkpoint's env id is data too: `module:Env` would import `module` when the env is made, so it is
    accepted only when this command line names the same id."""
    if ":" in saved and saved != given:
        raise RunError(
            f"{source} names the env {saved!r}, whose module prefix would import and run {saved.split(':')[0]!r}: "
            f"pass --env-id {saved} on this command line if you trust it"
        )


def rng_states(device: torch.device) -> dict:
    """Python's, NumPy's, torch's (and CUDA's) global RNG states, as data (ints, lists and tensors)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    numpy = dict(kind=kind, key=torch.from_numpy(key.astype(np.int64)), pos=pos, has_gauss=has_gauss, gauss=gauss)
    states = dict(python=random.getstate(), numpy=numpy, torch=torch.get_rng_state())
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = states["numpy"]
    if isinstance(numpy, dict):
        numpy = (
            numpy["kind"],
            numpy["key"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["gauss"],
        )
    np.random.set_state(numpy)  # a tuple: a checkpoint of the old format (--trust-checkpoint)
    torch.set_rng_state(states["torch"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


# ---------------------------------------------------------------------------------------------- env state as data
# One function pair per env family: the state a gymnasium env needs to continue exactly, as tensors and numbers,
# so that a checkpoint loads without unpickling objects. A family without one falls back to new episodes.
WRAPPER_STATE = ("_elapsed_steps", "_has_reset", "checked_reset", "checked_step", "checked_render")
"""the wrappers' own state: TimeLimit's step count, OrderEnforcing's and the env checker's flags"""
CLASSIC_CONTROL_STATE = ("state", "steps_beyond_terminated", "last_u")


def _as_data(value):
    """NumPy arrays and scalars as tensors (dtype kept), sequences element-wise; other values as they are."""
    if isinstance(value, (np.ndarray, np.generic)):
        return torch.from_numpy(np.array(value))
    if isinstance(value, (list, tuple)):
        return type(value)(_as_data(v) for v in value)
    return value


def _from_data(value):
    if isinstance(value, torch.Tensor):
        array = value.numpy()
        return array[()] if array.ndim == 0 else array
    if isinstance(value, (list, tuple)):
        return type(value)(_from_data(v) for v in value)
    return value


def _mujoco_state(base):
    import mujoco

    spec = mujoco.mjtState.mjSTATE_INTEGRATION  # time, qpos, qvel, act, warm start, controls, applied forces
    state = np.empty(mujoco.mj_stateSize(base.model, spec))
    mujoco.mj_getState(base.model, base.data, state, spec)
    return torch.from_numpy(state)


def _set_mujoco_state(base, state) -> None:
    import mujoco

    mujoco.mj_setState(base.model, base.data, state.numpy(), mujoco.mjtState.mjSTATE_INTEGRATION)


def _env_family(base) -> Optional[str]:
    module = type(base).__module__
    if module.startswith("gymnasium.envs.classic_control."):
        return "classic_control"
    if module.startswith("gymnasium.envs.mujoco.") and hasattr(base, "model") and hasattr(base, "data"):
        return "mujoco"
    return None


def _wrappers(env) -> list:
    chain = []
    while hasattr(env, "env"):
        chain.append(env)
        env = env.env
    return chain


def env_state(env) -> Optional[dict]:
    """A gymnasium env's state as data, or None for a family with no state function (see `set_env_states`)."""
    base = env.unwrapped
    family = _env_family(base)
    if family is None:
        return None
    if family == "mujoco":
        sim = _mujoco_state(base)
    else:
        sim = {name: _as_data(vars(base)[name]) for name in CLASSIC_CONTROL_STATE if name in vars(base)}
    wrappers = [{name: vars(w)[name] for name in WRAPPER_STATE if name in vars(w)} for w in _wrappers(env)]
    rng = dict(state=base.np_random.bit_generator.state, seed=base.np_random_seed)
    return dict(family=family, env=type(base).__name__, sim=sim, np_random=rng, wrappers=wrappers)


def set_env_states(run: Run, envs: list, states: Optional[list]) -> bool:
    """Continue each env of `envs` (freshly made, same ids) from its saved `env_state`; True if all could be.

    False when the family has no state function (or the checkpoint holds no env state): rank 0 says so once,
    and the script resets its envs with seeds no earlier attempt used, as the Atari scripts do.
    """
    if states is None or any(state is None for state in states):
        if run.is_main:
            print(
                f"  {type(envs[0].unwrapped).__name__}: no saved env state (no state function for this env family): "
                "the envs start new episodes, with seeds no earlier attempt used",
                flush=True,
            )
        return False
    for env, state in zip(envs, states, strict=True):
        base = env.unwrapped
        if state["family"] == "mujoco":
            _set_mujoco_state(base, state["sim"])
        else:
            for name, value in state["sim"].items():
                setattr(base, name, _from_data(value))
        base.np_random.bit_generator.state = state["np_random"]["state"]
        base._np_random_seed = state["np_random"]["seed"]
        for wrapper, saved in zip(_wrappers(env), state["wrappers"], strict=True):
            for name, value in saved.items():
                setattr(wrapper, name, value)
    return True


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def broadcast_from_main(run: Run, obj):
    """Rank 0's `obj` on every rank (one collective; nothing to do with one process)."""
    if run.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


FLAGS_FILE = "flags.json"
"""written into a new run directory: the script and flags that made it, so that a restart recognises its own"""
NOT_FROM_CHECKPOINT = ("track", "wandb_project_name", "wandb_entity", "trust_checkpoint", "resume")
"""flags always taken from this command line, never from a checkpoint (a file someone else may have written)"""


def check_run_name(run_name: str) -> None:
    """A run name is a plain directory name: not empty, not `.` or `..`, no leading dot."""
    if not run_name or run_name.startswith("."):
        raise RunError(f"--run-name must be a plain name (not empty, no leading dot, not . or ..), got {run_name!r}")


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


def resume(run: Run, args: RunArgs, required: tuple = ()) -> tuple[Any, Optional[dict]]:
    """Find the run directory and the checkpoint to continue from; returns (args, checkpoint or None).

    Rank 0 decides and every rank learns the outcome (or the same RunError). A checkpoint is taken
    from `--resume`, or from the run directory itself when it holds one written with the same flags as
    this command line (an elastic restart or a requeued job replays its command); a run directory of
    other flags is refused. A resumed run takes the checkpoint's flags as its defaults; flags given on this
    command line still win, except the env id and the global sizes, and the `NOT_FROM_CHECKPOINT` flags
    come from this command line only. At another world size, the per-rank flags are derived again from
    the checkpoint's global sizes (`per_rank_flags`); the value the checkpoint was written with is accepted
    too, since torchrun and SLURM replay the same command.
    """
    outcome = None
    if run.is_main:
        try:
            run_name, run.launch = args.run_name, launch_id()
            if run_name is None:
                run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{run.launch}"
            run_name = run_name.replace("/", "-")  # ALE/Pong-v5: one directory, not a nested one
            check_run_name(run_name)
            run_dir, source, new_dir, ckpt = os.path.join(args.runs_dir, run_name), args.resume, False, None
            if source is None and os.path.isfile(os.path.join(run_dir, "checkpoint.pt")):
                ckpt = load_checkpoint(run_dir, run.script, required, args.trust_checkpoint)
                diffs, source = differing_flags(ckpt["args"], args, ckpt["sizes"], run.world_size), run_dir
            elif source is None and os.path.lexists(run_dir):  # a restart before the first checkpoint, or not ours
                try:
                    with open(os.path.join(run_dir, FLAGS_FILE)) as f:
                        made_by = json.load(f)
                    diffs = differing_flags(made_by["args"], args) if made_by["script"] == run.script else ["--script"]
                except (OSError, ValueError, KeyError, TypeError):
                    diffs = ["(no flags.json: not made by this command)"]
            else:
                diffs, new_dir = [], source is None
            if diffs:
                raise RunError(
                    f"{run_dir} belongs to a run with other flags: {'; '.join(diffs[:4])}; pass --resume {run_dir} "
                    "to continue that run, or another --run-name for a new one (nothing was written)"
                )
            if source and ckpt is None:
                ckpt = load_checkpoint(source, run.script, required, args.trust_checkpoint)
            if ckpt is not None:
                if args.resume:  # continue writing into the directory of the checkpoint
                    run_dir = args.resume if os.path.isdir(args.resume) else os.path.dirname(args.resume) or "."
                saved = {k: v for k, v in ckpt["args"].items() if k in {f.name for f in fields(type(args))}}
                check_saved_env_id(str(saved.get("env_id")), args.env_id, source)
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
            if os.path.isdir(run_dir) and (held := lease.take(run_dir, run.launch)):  # before any file is touched
                raise RunError(held)
            outcome = (run_dir, args, ckpt, new_dir)
        except RunError as e:
            outcome = e
    outcome = broadcast_from_main(run, outcome)
    if isinstance(outcome, RunError):
        raise outcome
    run.run_dir, run.args, ckpt, run.new_dir = outcome
    run.wandb_run_id = ckpt.get("wandb_run_id") if ckpt else None
    if ckpt:
        check_run_flags(run.args)
    return run.args, ckpt


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


def rank_share(run: Run, ckpt: dict):
    """This rank's part of the checkpoint's per-rank state (`rank_state`), at any world size.

    Each rank saved a tuple of per-env sequences (lists, arrays or tensors, one entry per env, in env
    order). They are joined in global env order and split again for this world size, so every env
    continues exactly where it was, whichever rank steps it now. None when the ranks saved none.
    """
    saved = ckpt["rank_state"]
    if any(state is None for state in saved):
        return None
    share = []
    for parts in zip(*saved, strict=True):  # one field (envs, observations, ...) of every old rank
        if isinstance(parts[0], torch.Tensor):
            joined = torch.cat(parts)
        elif isinstance(parts[0], np.ndarray):
            joined = np.concatenate(parts)
        else:
            joined = [item for part in parts for item in part]
        local = len(joined) // run.world_size
        share.append(joined[run.rank * local : (run.rank + 1) * local])
    return tuple(share)


def resume_rng(run: Run, ckpt: dict, seed: int) -> None:
    """Every rank's RNG streams as saved; at another world size, new ones from (seed, rank, iteration).

    The saved streams belong to the old ranks: a changed world size cannot continue them, so it seeds
    streams that no earlier attempt used and that the same restart reproduces.
    """
    if ckpt["world_size"] == run.world_size:
        set_rng_states(ckpt["rng"][run.rank], run.device)
    else:
        seed_everything(int(np.random.SeedSequence([seed, run.rank, ckpt["iteration"]]).generate_state(1)[0]))


def save_checkpoint(run: Run, iteration: int, global_step: int, rank_state=None, **state) -> None:
    """Write {run dir}/checkpoint.pt atomically from rank 0, with every rank's RNG states (collective).

    `state` is the script's own, the same on every rank (agent, optimizer, ...); `rank_state` is each
    rank's own (its envs, say), saved as the list `ckpt["rank_state"]` by rank. A failed write (full
    disk, quota, read-only) stops every rank with one line; the previous checkpoint is left intact.
    """
    local = (rng_states(run.device), rank_state)
    gathered = [local]
    if run.world_size > 1:
        gathered = [None] * run.world_size
        dist.all_gather_object(gathered, local)
    all_rng, all_rank_state = [g[0] for g in gathered], [g[1] for g in gathered]
    error = None
    if run.is_main:
        sync_events(run.writer)  # the events up to this checkpoint reach the disk first: a crash after it loses none
        ckpt = dict(script=run.script, args=asdict(run.args), sizes=run.sizes, world_size=run.world_size)
        ckpt |= dict(versions=library_versions())
        ckpt |= dict(iteration=iteration, global_step=global_step, rng=all_rng, rank_state=all_rank_state)
        ckpt |= dict(wandb_run_id=run.wandb_run_id, **state)
        path = os.path.join(run.run_dir, "checkpoint.pt")
        try:
            atomic_save(ckpt, path)
        except OSError as e:
            error = f"could not write {path} ({e.strerror}); the previous checkpoint is intact"
    error = broadcast_from_main(run, error)
    if error:
        raise RunError(error)


def sync_events(writer) -> None:
    """Flush TensorBoard's event file and fsync it, so that it is as durable as the checkpoint written next."""
    writer.flush()
    event_writer = getattr(writer._get_file_writer(), "event_writer", None)
    path = getattr(event_writer, "_file_name", None)
    if path and os.path.exists(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------------- collectives
def preempted(run: Run) -> bool:
    """Whether any rank has received SIGTERM/SIGUSR1: one all-reduce of the votes, so all ranks agree."""
    vote = torch.tensor([float(bool(run.signals))], device=run.device)
    if run.world_size > 1:
        dist.all_reduce(vote)
    return vote.item() > 0


def all_sum(run: Run, metrics: dict) -> dict:
    """Sum named metrics over all ranks in one all-reduce (float64): a dict in, a dict of floats out."""
    values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=run.device) for v in metrics.values()])
    if run.world_size > 1:
        dist.all_reduce(values)
    return dict(zip(metrics, values.tolist(), strict=True))


def state_checksum(*objects) -> torch.Tensor:
    """A cheap fingerprint (int64 [2]) of the exact bits of modules, optimizers and tensors."""
    tensors = []
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state_dict()["state"].values():
                tensors += [v for v in state.values() if torch.is_tensor(v)]
        else:
            tensors += list(obj.state_dict().values())
    device = next((t.device for t in tensors), torch.device("cpu"))
    total = torch.zeros(2, dtype=torch.int64, device=device)
    views = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}
    views[torch.float16] = torch.int16
    for t in tensors:
        bits = t.detach().reshape(-1).to(device)
        bits = (bits.view(views[bits.dtype]) if bits.dtype in views else bits).to(torch.int64)
        total[0] += bits.sum()
        total[1] += (bits * torch.arange(1, bits.numel() + 1, device=device)).sum()
    return total


def check_replicas_in_sync(where: str, world_size: int, *objects) -> None:
    """Raise RunError (EXIT_DIVERGED) on every rank, naming the ranks, if any replica's bits differ from rank 0's."""
    if world_size == 1:
        return  # nothing to compare
    local = state_checksum(*objects)
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    bad = [r for r in range(1, world_size) if not torch.equal(gathered[r], gathered[0])]
    if bad:
        raise RunError(
            f"replicas diverged at {where}: rank(s) {bad} hold parameters, optimizer or other state that "
            "differs from rank 0's",
            EXIT_DIVERGED,
        )


def steps_crossed(prev_step: int, global_step: int, every: int) -> int:
    """How many multiples of `every` lie in (prev_step, global_step]: the schedule of periodic events.

    The global step grows by the global batch per iteration, so a period that is not a multiple of it
    is still kept on average, and every rank computes the same answer from the same global step.
    """
    return global_step // every - prev_step // every if every > 0 else 0


# ---------------------------------------------------------------------------------------------- logging
def open_logs(run: Run, sizes: dict, ckpt: Optional[dict]) -> None:
    """Create the run directory, then on rank 0 TensorBoard (and W&B with --track) and the sizes table on stdout."""
    run.sizes = sizes
    # A resumed run keeps its global batch: its schedules depend on it (`resume` already kept the env count;
    # another --num-steps would still change the batch).
    if ckpt and ckpt["sizes"].get("batch_size") != sizes.get("batch_size"):
        saved = ckpt["sizes"].get("batch_size")
        raise RunError(
            f"--resume: the checkpoint's batch_size is {saved}, not {sizes.get('batch_size')}: keep its sizes"
        )
    if ckpt and ckpt["iteration"] >= sizes.get("num_iterations", ckpt["iteration"] + 1):
        raise RunError(
            f"{run.run_dir} has finished: its checkpoint is at global step {ckpt['global_step']}, and "
            f"--total-timesteps {run.args.total_timesteps} asks for no more; to train on, pass --resume {run.run_dir} "
            "with a larger --total-timesteps (nothing was written)"
        )
    global_step = ckpt["global_step"] if ckpt else 0
    run.sps_window.append((time.time(), global_step))
    error = None
    if run.is_main:  # created only now: a run that fails its checks before this writes nothing
        try:
            if run.new_dir:  # claimed exclusively: never into a directory another run created
                os.makedirs(run.run_dir, exist_ok=True)  # (rank 0's evaluation recorder may have made it)
                error = lease.take(run.run_dir, run.launch)  # None, or the live run that holds it
                if error is None:
                    with open(os.path.join(run.run_dir, FLAGS_FILE), "x") as f:
                        json.dump(dict(script=run.script, args=asdict(run.args)), f, indent=1)
            else:
                probe = os.path.join(run.run_dir, f".write-test.{os.getpid()}")
                open(probe, "w").close()
                os.remove(probe)
        except FileExistsError:
            error = f"another run created {run.run_dir} meanwhile: pass another --run-name (nothing was written)"
        except OSError as e:
            error = f"cannot write to the run directory {run.run_dir}: {e.strerror}"
    error = broadcast_from_main(run, error)
    if error:
        raise RunError(error)
    if not run.is_main:
        return
    from torch.utils.tensorboard import SummaryWriter

    args = run.args
    config = {**asdict(args), **sizes}
    if args.track:
        import wandb

        # a resumed run passes the id saved in its checkpoint; a new one keeps the id W&B chose
        names = dict(project=args.wandb_project_name, entity=args.wandb_entity, name=os.path.basename(run.run_dir))
        options = dict(config=config, sync_tensorboard=True, save_code=True, resume="allow")
        run.wandb_run_id = wandb.init(**names, **options, id=run.wandb_run_id).id
    # purge_step drops events a crashed attempt logged after the checkpoint: no duplicate steps
    # (a restart before the first checkpoint purges from step 1)
    run.writer = SummaryWriter(run.run_dir, purge_step=None if run.new_dir else global_step + 1)
    _open_runs.append(run)  # closed on every way out (`close_logs`, from `exit_codes`)
    table = "\n".join(f"|{k}|{v}|" for k, v in config.items())
    run.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    print(f"{run.script}: {args.env_id}, run directory {run.run_dir}")
    for key, value in sizes.items():
        print(f"  {key:<22}{value}")
    if ckpt:
        print(f"  resuming at iteration {ckpt['iteration'] + 1}, global step {global_step}", flush=True)
    if ckpt and ckpt["world_size"] != run.world_size:
        print(
            f"  world size {ckpt['world_size']} -> {run.world_size}: global sizes kept, per-rank sizes derived "
            "again, RNG streams seeded from (seed, rank, iteration)",
            flush=True,
        )


def log(run: Run, global_step: int, scalars: dict, episodes: tuple) -> None:
    """Rank 0: write `scalars`, the episode means and SPS, and show progress (no collective).

    `episodes` is (sum of returns, sum of lengths, count) of the episodes that ended, over all ranks.
    """
    run.sps_window.append((time.time() - run.paused_seconds, global_step))
    (t0, s0), (t1, s1) = run.sps_window[0], run.sps_window[-1]
    sps = int((s1 - s0) / max(t1 - t0, 1e-9))
    if not run.is_main:
        return
    return_sum, length_sum, count = episodes
    scalars = {**scalars, "charts/episodes": count, "charts/SPS": sps}
    if count:
        scalars.update({"charts/episodic_return": return_sum / count, "charts/episodic_length": length_sum / count})
        run.recent_returns.append(return_sum / count)
    for tag, value in scalars.items():
        run.writer.add_scalar(tag, value, global_step)
    total = run.args.total_timesteps
    recent = np.mean(run.recent_returns) if run.recent_returns else float("nan")
    line = f"step {global_step}/{total} ({100 * global_step / total:.0f}%)  SPS {sps}  return {recent:.1f}"
    run.last_line = line
    if sys.stdout.isatty():  # one live line on a terminal, a line every 10 s in a log file
        print("\r" + line, end="", flush=True)
    elif time.time() - run.last_print >= 10:
        run.last_print, run.last_line = time.time(), ""
        print(line, flush=True)


@contextmanager
def off_the_clock(run: Run):
    """Time spent inside (evaluation) does not count in SPS."""
    started = time.time()
    try:
        yield
    finally:
        run.paused_seconds += time.time() - started


def video_dir(run: Run) -> Optional[str]:
    """Where rank 0's evaluation videos go, or None without --capture-video."""
    return os.path.join(run.run_dir, "videos") if run.args.capture_video else None


def write_video(frames: list, video_dir: str, name: str, fps: int) -> dict:
    """Write frames ([H, W] grayscale or [H, W, 3]) to {video_dir}/{name}.mp4; returns what `log_video` takes."""
    from moviepy.video.io.ImageSequenceClip import ImageSequenceClip

    rgb = np.stack(frames)
    rgb = np.repeat(rgb[..., None], 3, axis=-1) if rgb.ndim == 3 else rgb  # grayscale -> [T, H, W, 3]
    os.makedirs(video_dir, exist_ok=True)
    path = os.path.join(video_dir, f"{name}.mp4")
    ImageSequenceClip(list(rgb), fps=fps).write_videofile(path, logger=None)
    return dict(path=path, frames=rgb, fps=fps)


def log_video(writer, video: dict, global_step: int, track: bool) -> None:
    """Attach an evaluation video (from a script's `evaluate`) to TensorBoard and, with --track, to W&B."""
    frames = video["frames"][:: max(1, len(video["frames"]) // 200)]  # TensorBoard stores a GIF: keep it small
    fps = video["fps"] * len(frames) / len(video["frames"])
    writer.add_video("eval/video", frames.transpose(0, 3, 1, 2)[None], global_step, fps=max(1, round(fps)))
    if track:
        import wandb

        wandb.log({"eval/video": wandb.Video(video["path"], format="mp4")})


def log_evaluation(run: Run, result: Optional[tuple], global_step: int) -> bool:
    """Log rank 0's evaluation `result` (returns, lengths, video) and tell every rank whether to stop.

    The stop decision is broadcast, so all ranks leave the loop after the same iteration.
    """
    stop = False
    if run.is_main:
        returns, lengths, video = result
        run.writer.add_scalar("eval/episodic_return", returns.mean(), global_step)
        run.writer.add_scalar("eval/episodic_length", lengths.mean(), global_step)
        if video is not None:
            log_video(run.writer, video, global_step, run.args.track)
        target = run.args.target_return
        stop = target is not None and returns.mean() >= target
        if stop:
            print(
                f"\n{run.script}: evaluation return {returns.mean():.1f} reached --target-return {target} "
                f"at global step {global_step}; checkpoint saved in {run.run_dir}",
                flush=True,
            )
    return bool(broadcast_from_main(run, stop))


def finish(run: Run, global_step: int, preempted: bool, *envs) -> None:
    """Close `envs` (None: skipped) and the logs; after a preemption, say where to resume and exit 75."""
    for env in envs:
        if env is not None:
            env.close()
    if run.is_main:
        print("" if sys.stdout.isatty() else run.last_line, flush=True)  # end the live line, or show the last
        close_logs(EXIT_PREEMPTED if preempted else 0)
        if preempted:
            print(
                f"{run.script}: preempted by a signal at global step {global_step}; checkpoint saved in "
                f"{run.run_dir}; relaunch with --resume {run.run_dir} to continue",
                file=sys.stderr,
                flush=True,
            )
    if preempted:
        raise SystemExit(EXIT_PREEMPTED)


_open_runs: list = []  # rank 0's runs whose TensorBoard writer (and W&B run) `open_logs` opened


def close_logs(exit_code: int) -> None:
    """Flush and close rank 0's TensorBoard writer and finish its W&B run with `exit_code`; every way out of a
    run comes here (`finish`, and `exit_codes` after an error), so the last scalars are never lost."""
    while _open_runs:
        run = _open_runs.pop()
        try:
            run.writer.close()
            if run.args.track:
                import wandb

                wandb.finish(exit_code=exit_code)
        except Exception as e:  # on the way out after another error: say it, and leave anyway
            print(f"{run.script}: could not close the logs of {run.run_dir} ({type(e).__name__}: {e})", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- exit
def lost_rank_message(e: BaseException) -> Optional[str]:
    """The reason, if `e` is what a collective raises when a peer died or stalled past the timeout, else None."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if not (isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo" in text.lower())):
        return None
    return text.split("] ", 1)[-1].split(". This is typically", 1)[0][:160]  # drop the C++ source prefix


@contextmanager
def exit_codes(script: str):
    """Wrap a script's `main()`: one-line errors and exit codes, process-group teardown, then leave.

    RunError: rank 0 prints `{script}: error: ...` and every rank exits with its code. A failed collective
    (a lost rank): every surviving rank prints one line and exits with EXIT_LOST_RANK.
    """
    exit_code = 1
    try:
        yield
        exit_code = 0
    except SystemExit as e:
        exit_code = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:  # a second Ctrl-C (`interrupt`), or one before the handler was installed
        exit_code = EXIT_INTERRUPTED
        if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
            print(f"\n{script}: interrupted twice: stopped at once, without a checkpoint", file=sys.stderr, flush=True)
    except RunError as e:
        exit_code = e.code
        if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
            print(f"{script}: error: {e}", file=sys.stderr, flush=True)
        elif not dist.is_initialized():
            # Every rank found the same bad input before the ranks met; let rank 0 (maybe still starting
            # up) print it first: torchrun stops the other ranks as soon as one exits.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(5)
    except Exception as e:
        reason = lost_rank_message(e)
        if reason is None:
            import traceback

            traceback.print_exc()
        else:  # the other ranks cannot be told, so every surviving rank says it, in one line
            exit_code = EXIT_LOST_RANK
            rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))
            print(
                f"{script}: error: rank {rank} lost contact with the other ranks ({reason}): a rank died, stalled "
                "longer than --dist-timeout, or the network failed; relaunch to resume from the last checkpoint",
                file=sys.stderr,
                flush=True,
            )
    finally:
        close_logs(exit_code)
        if dist.is_initialized() and exit_code != EXIT_LOST_RANK:  # teardown could wait on the lost peers
            dist.destroy_process_group()
        # Leave without interpreter finalization: there, gloo's C++ threads can still call std::terminate
        # ("terminate called without an active exception", pytorch#179291) and turn a finished run, or the
        # one-line exit 4 of a lost rank, into SIGABRT. Logs and checkpoints are closed and flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
