"""The launcher's side of a run, which no script calls: who this process is (torchrun's or SLURM's
variables), the id of the launch, preemption signals, the elastic-restart checks, the device and the threads.

`runtime.start` and `run_dir.choose_run_dir` call these; habitat-lab keeps such helpers in its `ddp_utils.py`.
"""

import glob
import os
import re
import secrets
import signal
import sys
import time
from typing import Optional

import torch

from cleanrl_ddp.errors import RunError
from cleanrl_ddp.run import Run


# ---------------------------------------------------------------------------------------------- who this process is
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


def require_rendezvous_address(env, world_size: int, where: str) -> None:
    """Rank 0's address and port, which every rank of a process group needs (torchrun sets both)."""
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if world_size > 1 and var not in env:
            raise RunError(f"{where}, export {var} (e.g. the first host of the job and a free port)")


def read_launch_env() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's or SLURM's variables."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (or any env:// launcher)
        require_rendezvous_address(env, int(env["WORLD_SIZE"]), f"with WORLD_SIZE={env['WORLD_SIZE']}")
        local_rank, local_world_size = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))
        return int(env["RANK"]), local_rank, int(env["WORLD_SIZE"]), local_world_size
    if int(env.get("SLURM_NTASKS", 1)) > 1:  # srun, one task per process
        require_rendezvous_address(env, int(env["SLURM_NTASKS"]), "under srun")
        rank, local_rank = int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0))
        return rank, local_rank, int(env["SLURM_NTASKS"]), slurm_tasks_on_node(env)
    return 0, 0, 1, 1


def launch_id() -> str:
    """An id that names this launch and survives torchrun elastic restarts and SLURM requeues: torchrun's run id;
    else the SLURM job and step (`slurm<JOB_ID>.<STEP_ID>`: the runs of one allocation differ by step, a requeued
    job counts its steps from 0 again); else a random id, so that two launches in the same second differ. Rank 0
    calls it and broadcasts the run directory, so every rank agrees."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id not in ("", "none"):
        return run_id
    if "SLURM_JOB_ID" in os.environ:
        step = os.environ.get("SLURM_STEP_ID", "")
        return f"slurm{os.environ['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    return secrets.token_hex(4)


def default_run_name(runs_dir: str, prefix: str) -> str:
    """`{UTC start}__{prefix}__{launch id}`, so that `ls runs/` lists runs by start time; a restart of this launch
    (torchrun's elastic restarts, a requeued SLURM job: the same launch id) gets the name its first attempt made."""
    tag = re.sub(r"[^\w.-]", "-", launch_id())
    tag = tag[:8] if re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", tag) else tag  # a rendezvous UUID
    name = f"{prefix}__{tag}".replace("/", "-")  # ALE/Pong-v5: one directory, not a nested one
    stamp = "[0-9]" * 8 + "T" + "[0-9]" * 6 + "Z"
    earlier = sorted(glob.glob(os.path.join(glob.escape(runs_dir), f"{stamp}__{glob.escape(name)}")))
    start = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time()))
    return os.path.basename(earlier[0]) if earlier else f"{start}__{name}"


# ---------------------------------------------------------------------------------------------- preemption signals
def catch_signals(run: Run) -> None:
    """SIGTERM/SIGUSR1 and a first Ctrl-C only record the signal in `run.signals`: all ranks vote and stop together
    (`runtime.preempted`). A second Ctrl-C stops at once (`interrupt`)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: run.signals.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: interrupt(run))


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


# ---------------------------------------------------------------------------------------------- elastic restarts
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
    if not stable_id and run_name is None:  # launch_id() would be random: a restart would start a new run
        raise RunError(f"{what} needs a run name that survives restarts: pass --rdzv-id=JOB_ID")


# ---------------------------------------------------------------------------------------------- device and threads
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
