"""Check every CUDA path of the scripts on a GPU machine: one line per check (`ok`/`FAIL`/`skip`, its figure, its
seconds), each written to OUT/summary.txt the moment the check ends.

    python -m benchmark.gpu_check --out /tmp/gpu     # the quick profile: within --budget (360 s) on one H200
    python -m benchmark.gpu_check --full --out DIR    # every check (about 20-30 minutes)
    python -m benchmark.gpu_check --full --only resume evaluate --out DIR               # some checks again
    python -m benchmark.gpu_check --cleanrl-script benchmark/peers/cleanrl_ppo_atari_multigpu.py \
        --leanrl-script benchmark/peers/leanrl_ppo_atari.py   # + CleanRL's and LeanRL's (benchmark/device_wheels.sh)
    python -m benchmark.gpu_check --device cpu --out DIR   # the same checks on the CPU at tiny sizes (its CPU test)

The quick profile (the default) answers, in one command that fits a short GPU lease, whether every script works
and is fast on a GPU, the most important answers first. Its steps run one after another; the checks of one step
run at the same time (they check correctness, not speed), and a speed measurement always has the machine alone:
1. `script:<name>`: every `cleanrl_ddp/*_multigpu.py` at world size 1 for a few iterations (`FEW_ITERATIONS`);
   exit 0, its start line names the device, and its final checkpoint is at the requested global step; with them
   `graphs:` for the Atari PPO (the other Atari scripts' in `--full`): CUDA graphs against eager;
2. `gloo:`/`flat:` for the Atari PPO and SAC (2 ranks sharing the GPU through gloo, DDP and `--grad-sync flat`,
   replicas compared every iteration), `nccl-1` (an NCCL process group at world size 1: the collectives the
   scripts make), `sync-debug:` for the Atari PPO (its synchronizing CUDA operations, counted), `compile:` for the
   Atari PPO (2 ranks, DDP, `--compile`: CUDA graphs; torch's log of a graph run without CUDA graphs fails a
   compiled check), `resume` (a 2-rank run stopped by SIGTERM, resumed at world
   size 1 to its exact step), `evaluate` (a checkpoint trained on the device, on the device and on the CPU) and
   `graphs:` for SAC and TD3; the processes of a step's checks run with one thread each;
3. `throughput`: the Atari PPO's steady SPS at 8 and 64 envs next to the env-only ceiling of the same command
   (benchmark/throughput.py), with the update's share of the time; at 8 envs, where one iteration's time goes
   (benchmark/profile_rollout.py), CleanRL's own script (`--cleanrl-script`) and LeanRL's (`--leanrl-script`);
4. `graphs-speed:` for the Atari PPO (issue 41), then `env-sweep:8` (ALE's threads and batch size, env
   only), then `graphs-speed:` and `profile:` for SAC and TD3 (issue 42), each alone.
A check starts only if its estimated seconds on one H200 (`ESTIMATES`) end within `--budget` (default 360 s for
the quick profile on CUDA), else it is a `skip` line that says so: as estimated, the off-policy rows of step 4 are
left for a call of their own (`--only`). `--full` adds `gloo:`, `flat:`, `sync-debug:` for every script,
`compile:`/`compile-flat:` for the three scripts with `--compile` (`COMPILED`), `compile-speed:` for the Atari PPO
and SAC, `graphs:` for the six scripts with `--cudagraphs` (against eager), `nccl-guard` (NCCL with 2 ranks on one
GPU stops before init with one line), `env-sweep:64`, and for SAC and TD3 `leanrl:` (LeanRL's own script beside
ours, `--leanrl-sac-script`, `--leanrl-td3-script`), one check at a time, with no budget. docs/benchmarks.md says
what each check means, and the budget's table.

Results survive a kill: each check's output goes to OUT/logs/<check>.log while it runs, and its line is appended
to OUT/summary.txt as soon as it ends. A check past its time limit is killed with every process it started
(torchrun's ranks too, which run in sessions of their own: every process carries the marker GPU_CHECK_RUN in its
environment) and fails saying so. SIGTERM, SIGINT or SIGHUP to gpu_check kills every process it started, writes
which checks were unfinished to the summary, and exits 128 + the signal's number.

Without CUDA (and without `--device cpu`) it says so in one line and exits 0. Exit 1 when a check failed,
2 on bad flags.
"""

import argparse
import importlib.util
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ATARI = "ppo_atari_multigpu.py"
SAC = "sac_continuous_action_multigpu.py"
TD3 = "td3_continuous_action_multigpu.py"
ENV_ID = "BreakoutNoFrameskip-v4"
MARKER = "GPU_CHECK_RUN"  # in the environment of every process a check starts: how they are all found and killed
KILL_SECONDS = 5  # how long SIGKILL may take to end every marked process (then gpu_check names the ones left)

# The few-iteration run of each script at world size 1: its flags and the global step it must end at.
# A script added to cleanrl_ddp/ gets a row here; without one, its check fails and says so.
FEW_ITERATIONS = {
    "ppo_multigpu.py": ("--local-num-envs 4 --num-steps 32 --num-minibatches 2 --update-epochs 2", 3 * 4 * 32),
    "ppo_atari_multigpu.py": ("--local-num-envs 4 --num-steps 32 --num-minibatches 2 --update-epochs 2", 3 * 4 * 32),
    "ppo_atari_async_multigpu.py": (
        "--local-num-envs 4 --num-steps 32 --num-minibatches 2 --update-epochs 2",
        3 * 4 * 32,
    ),
    "ppo_continuous_action_multigpu.py": ("--num-steps 64 --num-minibatches 2 --update-epochs 2", 3 * 64),
    # PQN: the PPO scripts' sizes (3 iterations of 4 x 32 steps, 4 minibatch updates each)
    "pqn_multigpu.py": ("--local-num-envs 4 --num-steps 32 --num-minibatches 2 --update-epochs 2", 3 * 4 * 32),
    "pqn_atari_multigpu.py": ("--local-num-envs 4 --num-steps 32 --num-minibatches 2 --update-epochs 2", 3 * 4 * 32),
    # updates from global step 64, one every 4 (48 of them), the target network synced every 64
    "dqn_atari_multigpu.py": (
        "--local-num-envs 4 --buffer-size 512 --learning-starts 64 --train-frequency 4 --local-batch-size 32 "
        "--target-network-frequency 64 --log-every 64",
        256,
    ),
    # Pendulum-v1 (no MuJoCo needed), 1 env: updates from global step 64, one per step (192)
    "sac_continuous_action_multigpu.py": (
        "--env-id Pendulum-v1 --buffer-size 512 --learning-starts 64 --local-batch-size 32 --log-every 64",
        256,
    ),
    # the same for TD3: the actor and both target networks after every 2nd update (96)
    "td3_continuous_action_multigpu.py": (
        "--env-id Pendulum-v1 --buffer-size 512 --learning-starts 64 --local-batch-size 32 --log-every 64",
        256,
    ),
}
# graphs:<script>: --cudagraphs against eager, world size 1 (the Atari PPO also on 2 ranks), on each device: the flags
# and the global step; 8 iterations (PPO) of a float32 learning rate annealed in float32 numbers (`GRAPH_LR`), so
# that both runs take bitwise the same steps. The runs are correctness checks: they share the machine.
PPO_GRAPHS = ("--local-num-envs 4 --num-steps 32 --num-minibatches 2 --update-epochs 2", 8 * 4 * 32)
PPO_GRAPHS_CPU = ("--local-num-envs 1 --num-steps 4 --num-minibatches 1 --update-epochs 1", 8 * 1 * 4)
DQN_GRAPHS = "--buffer-size 512 --learning-starts 64 --train-frequency 4 --target-network-frequency 64 --log-every 64"
GRAPH_RUNS = {
    "cuda": dict.fromkeys((ATARI, "ppo_atari_async_multigpu.py", "pqn_atari_multigpu.py"), PPO_GRAPHS)
    | {"dqn_atari_multigpu.py": (f"--local-num-envs 4 --local-batch-size 32 {DQN_GRAPHS}", 512)},
    "cpu": dict.fromkeys((ATARI, "pqn_atari_multigpu.py"), PPO_GRAPHS_CPU)
    | {"ppo_atari_async_multigpu.py": (PPO_GRAPHS_CPU[0].replace("envs 1", "envs 2"), 2 * PPO_GRAPHS_CPU[1])}
    | {"dqn_atari_multigpu.py": (f"--local-num-envs 1 --local-batch-size 4 {DQN_GRAPHS}", 192)},
}
GRAPH_LR = 2**-12  # 0.000244140625: it and its annealed values k/8 (k/16 for the stopped run) are float32 numbers
NEEDS = {"ppo_continuous_action_multigpu.py": "mujoco"}  # a module beyond `pip install -e .`: skipped without it
COMPILED = ("ppo_atari_multigpu.py", "sac_continuous_action_multigpu.py", "td3_continuous_action_multigpu.py")
PER_SCRIPT = ("script", "gloo", "flat", "compile", "compile-flat", "compile-speed", "sync-debug", "profile", "graphs")
PER_SCRIPT += ("graphs-speed", "leanrl")
SINGLE = ("nccl-1", "nccl-guard", "resume", "evaluate", "throughput")
GRAPHS = (ATARI, "ppo_atari_async_multigpu.py", "pqn_atari_multigpu.py", "dqn_atari_multigpu.py")  # `graphs:`


@dataclass(frozen=True)
class Budget:
    """The sizes of the checks that are not per script: the one on a GPU, a tiny one for the CPU test."""

    resume_flags: str  # the 2-rank Atari PPO run that SIGTERM stops
    resume_iterations: int  # long enough that the signal lands before the end
    throughput_envs: tuple  # envs of the one rank measured
    throughput_iterations: int
    throughput_warmup: int
    throughput_num_steps: int
    ceiling_steps: int
    profile_iterations: int  # benchmark/profile_rollout.py's iterations at the first env count, after one warm-up
    speed_runs: dict  # compile-speed: script -> (flags, global step it ends at, logged SPS points skipped as warm-up)
    timeouts: dict  # check kind -> seconds one of its commands may take (then it is killed and fails)
    cleanrl_iterations: int  # CleanRL's script at the first throughput env count, steady after throughput_warmup
    leanrl_iterations: int  # LeanRL's prints its speed every 10 iterations after 3 of burn-in: the last is read
    env_sweep_steps: int  # agent steps timed per setting of `env-sweep:<envs>` (benchmark/throughput.py --env-sweep)
    graphs_two_ranks: bool = True  # graphs:ppo_atari_multigpu.py also on 2 ranks (the CPU test: the unit launch's)


# ---------------------------------------------------------------------------------------- the quick profile's budget
# The quick profile fits 6 minutes on one H200 (issue 41). ESTIMATES holds each check's seconds there (by name, else
# by kind), from the H200's quick profiles of 2026-11-26 (main 55bffaa, then eb68634 with every row of issues 41 and
# 42: its seconds where they differ); docs/benchmarks.md has the table with the source of each.
# `--budget` (360 s for the quick profile on CUDA) starts a check only if its estimate ends within the budget; a
# check that would not is a `skip` line saying so. Each time limit is a few times its estimate, so a hang costs
# minutes.
ESTIMATES = {
    "script": 26,  # 20-26 s each, 9 at once (9 s alone; 61-91 s beside 4 graphs: checks at 16 threads a process)
    "graphs": 63,  # SAC's and TD3's 4 runs at once: 62-63 s
    f"graphs:{ATARI}": 100,  # 6 runs at once, then 2 resumes: 146 s beside 12 checks at 16 threads a process
    "gloo": 40,  # 31 s (Atari PPO) and 39 s (SAC), beside the other checks of the step
    "flat": 40,  # 37 and 40 s
    "compile": 74,  # the compiled 2-rank Atari PPO: 60 s, 74 s beside 10 checks at 16 threads a process
    "nccl-1": 17,
    "sync-debug": 25,
    "resume": 76,  # 76 s beside 10 checks at 16 threads a process (69 s with 60 iterations, 24 now)
    "evaluate": 25,  # 13 s on cuda + 5 s on the CPU (one thread)
    "throughput": 195,  # 35 s (8 envs) + 35 (profile) + 23 (CleanRL) + 53 (LeanRL) + 49 (64 envs)
    f"graphs-speed:{ATARI}": 33,  # eager and CUDA graphs at 8 envs
    f"graphs-speed:{SAC}": 64,  # HalfCheetah-v5: eager, --cudagraphs, --cudagraphs --compile
    f"graphs-speed:{TD3}": 49,
    "profile": 28,  # one off-policy env step timed part by part, eager and --cudagraphs: 16 + 12 s (TD3 12 + 11)
    f"leanrl:{SAC}": 90,  # LeanRL's SAC and TD3, --compile --cudagraphs (issue 42's estimate)
    f"leanrl:{TD3}": 90,
    "env-sweep:8": 26,  # 8 settings of 4,000 agent steps at 3,000-6,000 steps/s, and a process start
    "env-sweep:64": 180,  # 10 settings at 64 envs, each with 64 envs to build: unfinished after 130 s
    f"compile-speed:{ATARI}": 56,
    f"compile-speed:{SAC}": 85,
    "nccl-guard": 8,
}
QUICK_BUDGET = 360  # seconds: the quick profile's default --budget on CUDA


def estimate(name: str) -> float:
    """A check's estimated seconds on one H200 (ESTIMATES, by name, else by kind; 60 when neither is known)."""
    return ESTIMATES.get(name, ESTIMATES.get(name.partition(":")[0], 60))


# Sizes: the Atari PPO's throughput 10 iterations, steady after 3 (7 iterations timed, 3.4 s at 2,100 SPS and 8 envs);
# the env-only ceiling 500 vector steps (0.9 s at 4,400 steps/s and 8 envs); CleanRL's script 8 iterations (5 timed,
# 9 s at 545 SPS); LeanRL's 20 (the last 10 timed).
GPU_BUDGET = Budget(
    resume_flags="--local-num-envs 4 --num-steps 32 --num-minibatches 2 --update-epochs 1",
    resume_iterations=24,
    throughput_envs=(8, 64),
    throughput_iterations=10,
    throughput_warmup=3,
    throughput_num_steps=128,
    ceiling_steps=500,
    profile_iterations=3,
    speed_runs={
        ATARI: ("--local-num-envs 8 --num-steps 128 --total-timesteps 20480", 20480, 4),
        SAC: ("--env-id Pendulum-v1 --learning-starts 500 --total-timesteps 3000 --log-every 250", 3000, 4),
    },
    timeouts={"script": 90, "gloo": 90, "flat": 90, "compile": 240, "compile-flat": 240, "compile-speed": 240}
    | {"nccl-1": 60, "sync-debug": 120, "nccl-guard": 60, "resume": 120, "evaluate": 90, "throughput": 180}
    | {"cleanrl": 180, "leanrl": 300, "env-sweep": 360, "profile": 120, "graphs-speed": 240}
    | {"graphs": 240},  # the Atari scripts' graphs: 6 processes at once, then 2 resumes
    cleanrl_iterations=8,
    leanrl_iterations=20,
    env_sweep_steps=4000,
)
CPU_BUDGET = Budget(
    resume_flags="--local-num-envs 1 --num-steps 16 --num-minibatches 1 --update-epochs 1",
    resume_iterations=30,
    throughput_envs=(2,),
    throughput_iterations=3,
    throughput_warmup=1,
    throughput_num_steps=16,
    ceiling_steps=20,
    profile_iterations=1,
    speed_runs={
        ATARI: ("--local-num-envs 2 --num-steps 16 --total-timesteps 192", 192, 1),
        SAC: ("--env-id Pendulum-v1 --learning-starts 64 --total-timesteps 256 --log-every 32", 256, 2),
    },
    timeouts=dict.fromkeys((*PER_SCRIPT, *SINGLE, "cleanrl", "leanrl", "env-sweep"), 400),  # a busy 2-core CI machine
    cleanrl_iterations=3,
    leanrl_iterations=20,
    env_sweep_steps=64,
    graphs_two_ranks=False,  # tests/dist_worker.py's unit launch compares the 2-rank --cudagraphs runs on the CPU
)
# The off-policy scripts' rows (issue 42), by device. profile: benchmark/profile_offpolicy.py's env, env steps with
# updates before the profiled ones, and profiled env steps. graphs-speed: the flags of the runs compared (world size
# 1, HalfCheetah-v5 on a GPU), the global step they end at, the SPS points skipped (random actions, capture), and the
# variants (--compile under --cudagraphs: inductor without its own CUDA graphs). graphs: the flags of the runs that
# --cudagraphs must equal (Pendulum-v1, no MuJoCo needed): at world size 1 and at 2 ranks (gloo, flat).
OFF_POLICY = (SAC, TD3)
OFF_POLICY_PROFILE = {"cuda": ("HalfCheetah-v5", 50, 500), "cpu": ("Pendulum-v1", 2, 5)}
GRAPHS_SPEED = {
    "cuda": (
        "--env-id HalfCheetah-v5 --learning-starts 1000 --total-timesteps 3000 --log-every 250",
        3000,
        6,
        ("", "--cudagraphs", "--cudagraphs --compile"),
    ),
    "cpu": (
        "--env-id Pendulum-v1 --learning-starts 32 --local-batch-size 16 --total-timesteps 80 --log-every 8",
        80,
        6,
        ("", "--cudagraphs"),
    ),
}
GRAPHS_EQUAL = {  # 400 critic updates at world size 1, 300 at 2 ranks
    "cuda": "--env-id Pendulum-v1 --learning-starts 200 --local-batch-size 64 --log-every 100 --total-timesteps",
    "cpu": "--env-id Pendulum-v1 --learning-starts 32 --local-batch-size 16 --log-every 16 --total-timesteps",
}
GRAPHS_TOTAL = {"cuda": {1: 600, 2: 800}, "cpu": {1: 48, 2: 48}}
EQUAL_RTOL = 1e-5  # the largest relative difference (|a - b| / |b| per tensor) that graphs: calls equal
GOALS = {8: 0.85, 64: 0.95}  # share of the env-only ceiling (issue #20); measured, never asserted
CLEANRL_GOAL = 5.0  # this script's SPS over CleanRL's at CleanRL's configuration
LEANRL_GOAL = 1.0  # this script's SPS over LeanRL's compile + CUDA-graph script's at 8 envs (issue 41)


def scripts() -> list[str]:
    """Every script of the package: the files the checks run at world size 1."""
    return sorted(p.name for p in (REPO / "cleanrl_ddp").glob("*_multigpu.py"))


def quick_profile() -> list[list[str]]:
    """The steps of the quick profile, most important first; the checks of a step run at the same time (correctness
    checks: they may share the GPU), a speed measurement has the machine alone (a step of its own)."""
    return [
        # graphs: of the Atari PPO (at 1 and 2 ranks); the three other Atari scripts' in --full (each was bitwise
        # equal to eager on the H200, 2026-11-26: docs/benchmarks.md)
        [f"script:{s}" for s in [ATARI, *[s for s in scripts() if s != ATARI]]] + [f"graphs:{ATARI}"],
        [f"gloo:{ATARI}", f"flat:{ATARI}", f"gloo:{SAC}", f"flat:{SAC}", "nccl-1", f"sync-debug:{ATARI}"]
        + [f"compile:{ATARI}", "resume", "evaluate", f"graphs:{SAC}", f"graphs:{TD3}"],
        ["throughput"],
        [f"graphs-speed:{ATARI}"],
        ["env-sweep:8"],
        *([f"graphs-speed:{s}"] for s in OFF_POLICY),
        *([f"profile:{s}"] for s in OFF_POLICY),
    ]


def full_profile() -> list[list[str]]:
    """Every check, one at a time."""
    names = [f"{kind}:{s}" for kind in ("script", "gloo", "flat") for s in scripts()]
    names += [f"graphs:{s}" for s in GRAPHS]
    names += [f"{kind}:{s}" for s in COMPILED for kind in ("compile", "compile-flat")]
    names += [f"sync-debug:{s}" for s in scripts()] + ["nccl-1"]
    names += [f"compile-speed:{s}" for s in GPU_BUDGET.speed_runs] + ["nccl-guard", "resume", "evaluate", "throughput"]
    names += [f"graphs-speed:{ATARI}"]
    names += [f"{kind}:{s}" for kind in ("profile", "graphs", "graphs-speed", "leanrl") for s in OFF_POLICY]
    names += [f"env-sweep:{n}" for n in GPU_BUDGET.throughput_envs]
    return [[name] for name in names]


@dataclass
class Result:
    name: str
    status: str  # "ok", "FAIL" or "skip"
    figure: str
    seconds: float = 0.0

    def line(self) -> str:
        return f"{self.status:<5} {self.name}: {self.figure} [{self.seconds:.0f} s]"


class Check:
    """Where the checks run: the device, their budget, the output folder, the runs they share, and every process
    they started (found by the marker in its environment)."""

    def __init__(self, device: str, budget: Budget, out: Path, cleanrl_script=None, leanrl_script=None, leanrl=None):
        self.device, self.budget, self.out, self.cleanrl_script = device, budget, out, cleanrl_script
        self.leanrl_script = leanrl_script  # LeanRL's PPO Atari (peers/leanrl_ppo_atari.py), by `throughput`
        self.leanrl_scripts = leanrl or {}  # SAC/TD3 -> LeanRL's script ported (benchmark/peers/leanrl_*.py)
        self.graphs_sps = {}  # script -> its --cudagraphs steady SPS in graphs-speed:, for the leanrl row
        self.runs, self.logs, self.summary = out / "runs", out / "logs", out / "summary.txt"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.marker = str(out.resolve())
        # every command inherits this environment: the repository importable without an install, and on CUDA one
        # GPU, however many there are (ranks share it: NCCL's guard)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        if device == "cuda":
            os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
        self.device_flags = [] if device == "cuda" else ["--no-cuda"]
        self.trained = {}  # script -> run directory of its `script:` check
        self.lock = threading.Lock()  # held to start a process, and to write the summary
        self.stopping = False  # set on a signal: no new process starts

    def command(self, script: str, flags, nproc: int = 1) -> list[str]:
        launcher = [sys.executable]
        if nproc > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        return [*launcher, str(REPO / "cleanrl_ddp" / script), *map(str, flags)]

    def limit(self, name: str) -> float:
        """Seconds one command of check `name` may take (`script:x`, `evaluate on cpu`, `cleanrl 8 envs`, ...)."""
        return self.budget.timeouts[re.split(r"[: ]", name)[0]]

    def log_path(self, name: str) -> Path:
        return self.logs / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.log"

    def start(self, name: str, cmd: list[str], env=None, cwd=REPO) -> subprocess.Popen:
        """Start `cmd` with its output going to logs/NAME.log as it comes, marked as this check's."""
        path = self.log_path(name)
        with self.lock:
            if self.stopping:
                raise InterruptedError("gpu_check is stopping")
            header = f"$ {shlex.join(cmd)}\n"
            with open(path, "w") as log:
                log.write(header)
                log.flush()
                env = {**(env or self.env), MARKER: self.marker, "GPU_CHECK_NAME": name}
                proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            proc.log_header = header
            return proc

    def finish(self, name: str, proc: subprocess.Popen) -> tuple[int | None, str]:
        """(exit code, or None when killed at the check's time limit; the output so far)."""
        try:
            code = proc.wait(timeout=self.limit(name))
        except subprocess.TimeoutExpired:
            code = None
        left = kill_marked(self.marker, name)  # at the limit; or what it left behind (a rank of a torchrun that died)
        try:
            proc.wait(timeout=KILL_SECONDS)  # never wait for ever on a process that did not die
        except subprocess.TimeoutExpired:
            left = left or [proc.pid]
        if left:
            raise RuntimeError(f"process(es) {left} still running after SIGKILL")
        return code, self.log_path(name).read_text()[len(proc.log_header) :]

    def run(self, name: str, cmd: list[str], env=None, cwd=REPO) -> tuple[int | None, str, float]:
        """(exit code or None after the check's time limit, output, seconds)."""
        start = time.monotonic()
        code, out = self.finish(name, self.start(name, cmd, env, cwd))
        return code, out, time.monotonic() - start

    def failed(self, name: str, code, out: str, what: str = "", log_name: str = "") -> Result:
        """A FAIL line: the exit code (or the time limit), the last line of output, where the log is."""
        reason = f"killed at its limit of {self.limit(name):.0f} s" if code is None else f"exit {code}"
        lines = [line.strip() for line in out.splitlines() if re.search(r"\w", line)]  # not torchrun's ====== rules
        last = next((line for line in reversed(lines) if ": error: " in line), lines[-1] if lines else "")
        return Result(name, "FAIL", f"{what or reason}: {last[:200]} (log: {self.log_path(log_name or name)})")

    def expected_device(self, out: str, script: str, world_size: int, backend: str) -> str | None:
        """Why the script's start line does not show the device and backend asked for (None: it does)."""
        stem = script.removesuffix(".py")
        device = "cuda:0" if self.device == "cuda" else "cpu"
        line = next((line for line in out.splitlines() if line.startswith(f"{stem}: {world_size} rank(s)")), None)
        if line is None:
            return f"no start line '{stem}: {world_size} rank(s), device ...'"
        if f", device {device}, " not in line or not line.endswith(f", backend {backend}"):  # threads come between
            return f"ran with '{line.split(', ', 1)[1]}', not device {device}, backend {backend}"
        return None

    def report(self, result: Result) -> None:
        with self.lock:
            if self.stopping:  # killed by gpu_check's own stop: the summary names it unfinished
                return
            append(self.summary, result.line())
            print(result.line(), flush=True)


def append(path: Path, line: str) -> None:
    """One line at the end of `path`, on disk before this returns."""
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def marked(marker: str, name: str | None = None) -> list[int]:
    """The processes whose environment holds MARKER=marker (and GPU_CHECK_NAME=name, when given)."""
    wanted = [f"{MARKER}={marker}".encode()] + ([f"GPU_CHECK_NAME={name}".encode()] if name else [])
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:  # gone, or not ours
                continue
            if all(w in env for w in wanted):
                pids.append(int(entry.name))
    return pids


def kill_marked(marker: str, name: str | None = None) -> list[int]:
    """SIGKILL every marked process, again until none is left (one may start another meanwhile); returns those
    still there after KILL_SECONDS (none, unless a process cannot die: stuck in a driver call, say)."""
    deadline = time.monotonic() + KILL_SECONDS
    while time.monotonic() < deadline:
        pids = marked(marker, name)
        if not pids:
            return []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return marked(marker, name)


def final_step(run_dir: Path) -> tuple[int, int]:
    """(global step, world size) of the run's checkpoint."""
    import torch

    ckpt = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    return ckpt["global_step"], ckpt["world_size"]


def flag(flags: str, name: str) -> int:
    words = shlex.split(flags)
    return int(words[words.index(name) + 1])


def local_steps(flags: str) -> int:
    """Env steps per rank per iteration of a PPO script's flags."""
    return flag(flags, "--local-num-envs") * flag(flags, "--num-steps")


def missing(script: str) -> str:
    """Why `script` cannot run here (a module beyond `pip install -e .`), or "" when it can."""
    import importlib.util

    module = NEEDS.get(script)
    return (
        f"needs {module} (pip install -e '.[{module}]')" if module and importlib.util.find_spec(module) is None else ""
    )


# ---------------------------------------------------------------------------------------------- checks
def check_script(c: Check, script: str) -> Result:
    name = f"script:{script}"
    if script not in FEW_ITERATIONS:
        return Result(name, "FAIL", "no row for it in FEW_ITERATIONS (benchmark/gpu_check.py): add its flags")
    if missing(script):
        return Result(name, "skip", missing(script))
    flags, total = FEW_ITERATIONS[script]
    run_name = f"check-{script.removesuffix('.py')}"
    cmd = c.command(script, [*shlex.split(flags), "--total-timesteps", total, "--seed", 1, *c.device_flags])
    cmd += ["--runs-dir", str(c.runs), "--run-name", run_name, "--checkpoint-every", "0"]
    code, out, _ = c.run(name, cmd)
    if code != 0:
        return c.failed(name, code, out)
    wrong = c.expected_device(out, script, 1, "none (one process)")
    if wrong:
        return c.failed(name, code, out, wrong)
    step, _ = final_step(c.runs / run_name)
    if step != total:
        return c.failed(name, code, out, f"its checkpoint is at global step {step}, not {total}")
    c.trained[script] = c.runs / run_name
    device = "cuda:0" if c.device == "cuda" else "cpu"
    return Result(name, "ok", f"world size 1 on {device}, global step {total}, exit 0")


# torch's own logs of the compiled runs: a graph that runs without CUDA graphs ("skipping cudagraphs due to ...")
# and a function compiled again ("Recompiling function ...")
COMPILE_LOGS = {"TORCH_LOGS": "perf_hints,cudagraphs,recompiles"}


def compile_notes(out: str) -> tuple[list[str], int]:
    """(the distinct reasons torch gave for running a compiled graph without CUDA graphs, the recompilations)."""
    skips = sorted(set(re.findall(r"skipping cudagraphs due to ([^\n]{0,150})", out)))
    return skips, len(re.findall(r"Recompiling function", out))


def check_two_ranks(c: Check, script: str, kind: str, extra=()) -> Result:
    """`script` on 2 ranks sharing the device (gloo) for twice its few iterations, replicas compared every iteration;
    `kind` names the check (gloo, flat, compile, compile-flat) and `extra` its flags."""
    name = f"{kind}:{script}"
    if missing(script):
        return Result(name, "skip", missing(script))
    flags, total = FEW_ITERATIONS[script]
    run_name = f"check-{kind}-{script.removesuffix('.py')}"
    cmd = c.command(script, [*shlex.split(flags), "--total-timesteps", 2 * total, *extra, *c.device_flags], nproc=2)
    cmd += ["--backend", "gloo", "--sync-check-every", "1", "--runs-dir", str(c.runs), "--run-name", run_name]
    cmd += ["--checkpoint-every", "0"]
    code, out, _ = c.run(name, cmd, env={**c.env, **COMPILE_LOGS} if "--compile" in extra else None)
    if code != 0:
        return c.failed(name, code, out)
    skips, recompiles = compile_notes(out)
    if skips and c.device == "cuda":
        return c.failed(name, code, out, f"compiled graphs ran without CUDA graphs: {'; '.join(skips)}")
    wrong = c.expected_device(out, script, 2, "gloo")
    if wrong:
        return c.failed(name, code, out, wrong)
    step, world_size = final_step(c.runs / run_name)
    if (step, world_size) != (2 * total, 2):
        return c.failed(name, code, out, f"its checkpoint is at global step {step}, world size {world_size}")
    compiled = f", {recompiles} recompilation(s) on both ranks" if "--compile" in extra else ""
    return Result(
        name,
        "ok",
        f"2 ranks sharing the device{' with ' + ' '.join(extra) if extra else ''}, replicas equal after every "
        f"iteration, global step {2 * total}{compiled}",
    )


def check_gloo(c: Check, script: str) -> Result:
    return check_two_ranks(c, script, "gloo")


def check_flat(c: Check, script: str) -> Result:
    return check_two_ranks(c, script, "flat", ["--grad-sync", "flat"])


def check_compile(c: Check, script: str) -> Result:
    """--compile on 2 ranks under DDP (CUDA graphs on CUDA)."""
    return check_two_ranks(c, script, "compile", ["--compile"])


def check_compile_flat(c: Check, script: str) -> Result:
    return check_two_ranks(c, script, "compile-flat", ["--compile", "--grad-sync", "flat"])


NCCL_ONE = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from cleanrl_ddp.sac_continuous_action_multigpu import TwinQ, all_reduce_gradients_flat
os.environ |= dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("NCCL_ONE_PORT", "29533"))
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
torch.manual_seed(0)
qf = TwinQ(3, 1).to(device)
before = [p.detach().clone() for p in qf.parameters()]
for p in qf.parameters():
    dist.broadcast(p.data, src=0)
assert all(torch.equal(a, p) for a, p in zip(before, qf.parameters())), "broadcast changed the weights"
obs, act = torch.randn(64, 3, device=device), torch.randn(64, 1, device=device)
sum(q.pow(2).mean() for q in DDP(qf)(obs, act)).backward()  # both critics: every parameter gets a gradient
ddp_grads = [p.grad.clone() for p in qf.parameters()]
qf.zero_grad()
sum(q.pow(2).mean() for q in qf(obs, act)).backward()
all_reduce_gradients_flat(list(qf.parameters()), 1)
plain = [p.grad for p in qf.parameters()]
assert all(torch.allclose(a, b) for a, b in zip(ddp_grads, plain)), "DDP's gradients differ from one process's"
total = torch.ones(3, device=device, dtype=torch.float64)
dist.all_reduce(total)
assert total.tolist() == [1.0, 1.0, 1.0], total
dist.destroy_process_group()
print("nccl-1: broadcast, DDP backward, flat all-reduce and a float64 all-reduce at world size 1: ok")
"""


def check_nccl_one(c: Check) -> Result:
    """An NCCL process group at world size 1 (the scripts join none at world size 1: their collectives, run here)."""
    name = "nccl-1"
    if c.device != "cuda":
        return Result(name, "skip", "NCCL needs CUDA")
    code, out, _ = c.run(name, [sys.executable, "-c", NCCL_ONE])
    if code != 0 or "nccl-1: " not in out:
        return c.failed(name, code, out)
    return Result(name, "ok", out.strip().splitlines()[-1][8:])


SYNC_DEBUG = """
import runpy, sys, warnings, torch
warnings.simplefilter("always")  # every synchronizing operation, not the first of each line
torch.cuda.set_sync_debug_mode("warn")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def check_sync_debug(c: Check, script: str) -> Result:
    """`script`'s few iterations at world size 1 under torch.cuda.set_sync_debug_mode("warn"): its syncs, counted."""
    name = f"sync-debug:{script}"
    if c.device != "cuda":
        return Result(name, "skip", "torch.cuda.set_sync_debug_mode needs CUDA")
    if missing(script):
        return Result(name, "skip", missing(script))
    flags, total = FEW_ITERATIONS[script]
    run_name = f"check-sync-{script.removesuffix('.py')}"
    cmd = c.command(script, [*shlex.split(flags), "--total-timesteps", total, "--seed", 1, *c.device_flags])
    cmd = [sys.executable, "-c", SYNC_DEBUG, *cmd[1:], "--runs-dir", str(c.runs), "--run-name", run_name]
    code, out, _ = c.run(name, cmd)
    if code != 0:
        return c.failed(name, code, out)
    syncs = len(re.findall(r"called a synchronizing CUDA operation", out))
    return Result(
        name,
        "ok",
        f"{syncs} synchronizing CUDA operations over {total} env steps ({syncs / total:.2f} per env step, set-up, "
        "logging and checkpoint included)",
    )


def check_compile_speed(c: Check, script: str, kind: str = "compile-speed", option: str = "--compile") -> Result:
    """`script` at world size 1, eager then with `option` (--compile), in this call: both end at their exact step;
    steady SPS."""
    from benchmark import throughput as tp
    from benchmark.events import read_scalar_events

    name = f"{kind}:{script}"
    flags, total, warmup = c.budget.speed_runs[script]
    sps = {}
    for compiled in (False, True):
        run_name = f"check-{kind}-{script.removesuffix('.py')}-{int(compiled)}"
        cmd = c.command(script, [*shlex.split(flags), *([option] if compiled else []), *c.device_flags])
        cmd += ["--runs-dir", str(c.runs), "--run-name", run_name, "--checkpoint-every", "0"]
        label = f"the {option} run" if compiled else "the eager run"
        log_name = f"{name} {option.removeprefix('--') if compiled else 'eager'}"
        code, out, seconds = c.run(log_name, cmd, env={**c.env, **COMPILE_LOGS} if compiled else None)
        if code != 0:
            why = f"killed at its limit of {c.limit(name):.0f} s" if code is None else f"exited {code}"
            return c.failed(name, code, out, f"{label} {why}", log_name)
        step, _ = final_step(c.runs / run_name)
        if step != total:
            return c.failed(name, code, out, f"{label} ended at global step {step}, not {total}", log_name)
        sps[compiled] = (tp.steady_sps(read_scalar_events(c.runs / run_name)[tp.SPS_TAG], warmup), seconds)
    skips, recompiles = compile_notes(out)
    if skips and c.device == "cuda":
        return c.failed(name, code, out, f"compiled graphs ran without CUDA graphs: {'; '.join(skips)}", log_name)
    (eager, eager_s), (compiled, compiled_s) = sps[False], sps[True]
    if option != "--compile":
        return Result(
            name,
            "ok",
            f"{eager:,.0f} SPS eager ({eager_s:.0f} s), {compiled:,.0f} SPS with {option} ({compiled_s:.0f} s): "
            f"{compiled / eager:.2f}x steady (the first {warmup} logged iterations excluded), both at global step "
            f"{total}",
        )
    return Result(
        name,
        "ok",
        f"{eager:,.0f} SPS eager ({eager_s:.0f} s), {compiled:,.0f} SPS with --compile ({compiled_s:.0f} s, the "
        f"compile included): {compiled / eager:.2f}x steady (compile time excluded), both at global step {total}, "
        f"{recompiles} recompilation(s)",
    )


def check_profile(c: Check, script: str) -> Result:
    """benchmark/profile_offpolicy.py: one env step of SAC or TD3 at world size 1, timed part by part."""
    name = f"profile:{script}"
    env_id, warmup, steps = OFF_POLICY_PROFILE[c.device]
    if env_id.endswith("-v5") and importlib.util.find_spec("mujoco") is None:
        return Result(name, "skip", f"{env_id} needs mujoco (pip install -e '.[mujoco]')")
    results = []
    for graphed in (False, True) if c.device == "cuda" else (False,):  # on the CPU --cudagraphs runs eagerly
        label = f"profile{' --cudagraphs' if graphed else ''}:{script}"
        cmd = [sys.executable, "-m", "benchmark.profile_offpolicy", "--script", script, "--env-id", env_id]
        cmd += ["--warmup", str(warmup), "--steps", str(steps), "--device", c.device] + ["--cudagraphs"] * graphed
        code, out, seconds = c.run(label, cmd)
        found = re.search(r"^profile: (.*)$", out, re.MULTILINE)
        results.append(
            c.failed(label, code, out) if code != 0 or found is None else Result(label, "ok", found.group(1))
        )
        results[-1].seconds = seconds
    return results


def check_graphs_speed_offpolicy(c: Check, script: str) -> Result:
    """`script` at world size 1, eager then --cudagraphs (then with --compile too, on CUDA), in this call: each ends
    at its exact step; their steady SPS once updates run (the capture excluded) and the ratios to eager."""
    from benchmark import throughput as tp
    from benchmark.events import read_scalar_events

    name = f"graphs-speed:{script}"
    flags, total, warmup, variants = GRAPHS_SPEED[c.device]
    if "-v5" in flags and importlib.util.find_spec("mujoco") is None:
        return Result(name, "skip", "HalfCheetah-v5 needs mujoco (pip install -e '.[mujoco]')")
    figures, eager = [], None
    for variant in variants:
        run_name = f"check-graphs-speed-{script.removesuffix('.py')}-{'-'.join(variant.split()) or 'eager'}"
        cmd = c.command(script, [*shlex.split(flags), *shlex.split(variant), "--seed", 1, *c.device_flags])
        cmd += ["--runs-dir", str(c.runs), "--run-name", run_name, "--checkpoint-every", "0"]
        log_name = f"{name} {variant or 'eager'}"
        code, out, seconds = c.run(log_name, cmd, env={**c.env, **COMPILE_LOGS} if "--compile" in variant else None)
        if code != 0:
            return c.failed(name, code, out, f"the {variant or 'eager'} run exited {code}", log_name)
        step, _ = final_step(c.runs / run_name)
        if step != total:
            return c.failed(name, code, out, f"the {variant or 'eager'} run ended at global step {step}", log_name)
        sps = tp.steady_sps(read_scalar_events(c.runs / run_name)[tp.SPS_TAG], warmup)
        c.graphs_sps[script] = sps if variant == "--cudagraphs" else c.graphs_sps.get(script)
        eager = eager or sps
        figures.append(
            f"{sps:,.0f} SPS {variant or 'eager'} ({seconds:.0f} s)" + (f" = {sps / eager:.2f}x" * bool(variant))
        )
    env_id = shlex.split(flags)[1]
    return Result(
        name, "ok", f"{env_id}, world size 1, steady SPS once updates run: {', '.join(figures)}; all at {total}"
    )


def check_graphs_offpolicy(c: Check, script: str) -> Result:
    """--cudagraphs against eager, same seed and flags, at world size 1 and at 2 ranks sharing the device (gloo,
    --grad-sync flat, replicas compared every iteration), all four runs at once: the final checkpoints' learned
    tensors (networks, targets, optimizer state, log_alpha) equal, bitwise or within EQUAL_RTOL."""
    name = f"graphs:{script}"
    stem, procs, figures = script.removesuffix(".py"), {}, []
    for ws in (1, 2):
        flags = [*shlex.split(GRAPHS_EQUAL[c.device]), GRAPHS_TOTAL[c.device][ws]]
        flags += ["--backend", "gloo", "--grad-sync", "flat", "--sync-check-every", "1"] if ws == 2 else []
        for graphed in (False, True):
            run_name = f"check-graphs-{stem}-{ws}-{'graphed' if graphed else 'eager'}"
            cmd = c.command(script, [*flags, "--seed", 1, *c.device_flags] + ["--cudagraphs"] * graphed, nproc=ws)
            cmd += ["--runs-dir", str(c.runs), "--run-name", run_name, "--checkpoint-every", "0"]
            log_name = f"{name} {ws} rank(s) {'graphed' if graphed else 'eager'}"
            procs[(ws, graphed)] = (log_name, run_name, c.start(log_name, cmd))
    for log_name, _, proc in procs.values():  # all of them, so that none is left running
        proc.result = c.finish(log_name, proc)
    for log_name, _, proc in procs.values():
        if proc.result[0] != 0:
            return c.failed(name, proc.result[0], proc.result[1], f"{log_name} exited {proc.result[0]}", log_name)
    for ws in (1, 2):
        eager, graphed = (load_learned(c.runs / procs[(ws, g)][1]) for g in (False, True))
        if not eager or set(graphed) != set(eager):
            what = f"at {ws} rank(s) the checkpoints hold {sorted(graphed)} with --cudagraphs, {sorted(eager)} eager"
            return c.failed(name, 0, procs[(ws, True)][2].result[1], what, procs[(ws, True)][0])
        worst, where = max((relative_difference(graphed[k], eager[k]), k) for k in eager)
        if worst > EQUAL_RTOL:
            what = f"at {ws} rank(s) --cudagraphs differs from eager: {where} by {worst:.2e} (> {EQUAL_RTOL:.0e})"
            return c.failed(name, 0, procs[(ws, True)][2].result[1], what, procs[(ws, True)][0])
        how = "bitwise" if worst == 0 else f"to {worst:.1e} relative (not bitwise)"
        figures.append(f"{ws} rank(s): {len(eager)} tensors equal {how}")
    updates = {ws: torch_load(c.runs / procs[(ws, True)][1])["num_updates"] for ws in (1, 2)}
    return Result(
        name,
        "ok",
        f"--cudagraphs equals eager after {updates[1]} updates at world size 1, {updates[2]} at 2 "
        f"ranks sharing the device (gloo, flat, replicas compared every iteration): {'; '.join(figures)}",
    )


# LeanRL's own scripts (ported, benchmark/peers/leanrl_*.py) with its fastest flags, as graphs-speed: runs ours on CUDA
LEANRL_FLAGS = "--env-id HalfCheetah-v5 --learning-starts 1000 --total-timesteps 3000 --seed 1 --compile --cudagraphs"


def check_leanrl(c: Check, script: str) -> Result:
    """LeanRL's SAC or TD3 (`--leanrl-sac-script`, `--leanrl-td3-script`) on HalfCheetah-v5 with --compile
    --cudagraphs, its own speed measure (SPS from 3 steps after learning starts, the last one its progress bar
    shows), next to ours with --cudagraphs from graphs-speed: when that ran earlier in this call."""
    algo = script.split("_")[0]
    name = f"leanrl:{script}"
    path = c.leanrl_scripts.get(script)
    if not path:
        return Result(name, "skip", f"no --leanrl-{algo}-script: LeanRL's script not run")
    if importlib.util.find_spec("torchrl") is None:
        return Result(name, "skip", "LeanRL's script needs torchrl (pip install torchrl==0.14.1)")
    if importlib.util.find_spec("mujoco") is None:
        return Result(name, "skip", "HalfCheetah-v5 needs mujoco (pip install -e '.[mujoco]')")
    workdir = c.out / "leanrl"
    workdir.mkdir(exist_ok=True)
    flags = shlex.split(LEANRL_FLAGS) if c.device == "cuda" else [*shlex.split(LEANRL_FLAGS)[:-2], "--no-cuda"]
    if c.device == "cpu":  # a few updates, eagerly: the port runs
        flags[flags.index("--learning-starts") + 1], flags[flags.index("--total-timesteps") + 1] = "64", "110"
    code, out, seconds = c.run(name, [sys.executable, str(Path(path).resolve()), *flags], cwd=workdir)
    speeds = re.findall(r"([\d.]+) sps", out)
    if code != 0 or not speeds:
        return c.failed(name, code, out)
    theirs, ours = float(speeds[-1]), c.graphs_sps.get(script)
    how = "--compile --cudagraphs" if c.device == "cuda" else "eager"
    figure = f"LeanRL's {Path(path).name} {how}: {theirs:,.1f} SPS ({seconds:.0f} s)"
    figure += f"; {script} --cudagraphs {ours:,.0f} SPS = {ours / theirs:.2f}x of it" if ours else ""
    return Result(name, "ok", figure, seconds)


def torch_load(run_dir: Path) -> dict:
    import torch

    return torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)


def load_learned(run_dir: Path) -> dict:
    """Every tensor of the checkpoint's learned state (not its RNG states or metadata), by path."""
    import torch

    ckpt, out = torch_load(run_dir), {}

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")
        elif isinstance(x, torch.Tensor):
            out[path] = x

    skip = {"args", "sizes", "versions", "rng", "rank_state", "wandb_run_id", "agent_kwargs"}
    walk({k: v for k, v in ckpt.items() if k not in skip}, "")
    return out


def relative_difference(a, b) -> float:
    """|a - b| / |b| (0 when both are equal; float64)."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    return 0.0 if bool((a == b).all()) else float((a - b).norm() / max(float(b.norm()), 1e-30))


def check_graphs_speed_atari(c: Check, script: str) -> Result:
    """`script` at world size 1, eager then --cudagraphs, as compile-speed: both to their exact step; steady SPS."""
    return check_compile_speed(c, script, "graphs-speed", "--cudagraphs")


def checkpoint_differences(a: Path, b: Path) -> list[str]:
    """Where two checkpoints' parameters, optimizer state and RNG streams (CUDA's included) differ in any bit: for
    each differing tensor its name and the largest difference relative to the tensor's largest magnitude."""
    import torch
    from torch.utils._pytree import keystr, tree_flatten_with_path

    ckpts = [torch.load(p / "checkpoint.pt", map_location="cpu", weights_only=True) for p in (a, b)]
    keys = [k for k in ("agent", "q_network", "target_network", "optimizer", "rng") if k in ckpts[0]]
    out = []
    for key in keys:
        leaves = [tree_flatten_with_path(ckpt[key])[0] for ckpt in ckpts]
        if [path for path, _ in leaves[0]] != [path for path, _ in leaves[1]]:
            out.append(f"{key}: other entries")
            continue
        for (path, x), (_, y) in zip(*leaves, strict=True):
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                if x.shape != y.shape or not torch.equal(x, y):
                    scale = x.double().abs().max().clamp_min(1e-30) if x.is_floating_point() else 1.0
                    rel = float((x.double() - y.double()).abs().max() / scale) if x.shape == y.shape else float("inf")
                    out.append(f"{key}{keystr(path)} ({rel:.1e})")
            elif x != y:
                out.append(f"{key}{keystr(path)}")
    return out


def check_graphs_atari(c: Check, script: str) -> Result:
    """--cudagraphs against eager from the same seeds (docs/benchmarks.md#graphs): the final checkpoints of a run with
    and without it at world size 1, bitwise (the same kernels replay, the same random numbers); a --cudagraphs run
    stopped by SIGTERM after a checkpoint, resumed once with and once without it, bitwise; for the Atari PPO also 2
    ranks sharing the device (gloo), --cudagraphs under DDP and with --grad-sync flat against eager DDP."""
    import shutil

    name, stem = f"graphs:{script}", script.removesuffix(".py")
    if script not in GRAPH_RUNS[c.device]:
        return Result(name, "FAIL", "no row for it in GRAPH_RUNS (benchmark/gpu_check.py): add its flags")
    flags, total = GRAPH_RUNS[c.device][script]
    base = [*shlex.split(flags), "--learning-rate", GRAPH_LR, "--seed", 1, *c.device_flags]
    runs = {  # run -> (processes, its flags)
        "eager": (1, ["--total-timesteps", total]),
        "graphs": (1, ["--cudagraphs", "--total-timesteps", total]),
        # twice as long: it cannot finish before the signal lands
        "stopped": (1, ["--cudagraphs", "--total-timesteps", 2 * total, "--checkpoint-every", "1"]),
    }
    two_ranks = script == ATARI and c.budget.graphs_two_ranks
    if two_ranks:
        for run, extra in (("eager-2", []), ("graphs-2", ["--cudagraphs"]), ("graphs-flat-2", ["--cudagraphs"])):
            sync = ["--grad-sync", "flat"] if "flat" in run else []
            runs[run] = (2, [*extra, *sync, "--total-timesteps", 2 * total, "--backend", "gloo"])
    procs = {}
    for run, (nproc, extra) in runs.items():
        cmd = c.command(script, [*base, *extra], nproc) + [
            "--runs-dir",
            str(c.runs),
            "--run-name",
            f"check-graphs-{stem}-{run}",
        ]
        cmd += [] if "--checkpoint-every" in extra else ["--checkpoint-every", "0"]
        procs[run] = c.start(f"{name} {run}", cmd)
    stopped = c.runs / f"check-graphs-{stem}-stopped"
    start = time.monotonic()
    while not (stopped / "checkpoint.pt").exists() and procs["stopped"].poll() is None:
        if time.monotonic() - start > c.limit(name):
            break
        time.sleep(0.05)
    if procs["stopped"].poll() is None:
        os.kill(procs["stopped"].pid, signal.SIGTERM)
    outs = {run: c.finish(f"{name} {run}", proc) for run, proc in procs.items()}
    for run, (code, out) in outs.items():
        if code != 0 and not (run == "stopped" and "preempted by a signal at global step" in out):
            return c.failed(name, code, out, f"the {run} run exited {code}", f"{name} {run}")
    stopped_at = re.search(r"preempted by a signal at global step (\d+);", outs["stopped"][1])
    if stopped_at is None:
        return c.failed(name, 0, outs["stopped"][1], "the stopped run was not stopped by SIGTERM", f"{name} stopped")
    resumed = {}
    for run in ("resumed-eager", "resumed-graphs"):
        shutil.copytree(stopped, c.runs / f"check-graphs-{stem}-{run}")
        flag_ = "--cudagraphs" if run == "resumed-graphs" else "--no-cudagraphs"
        cmd = [*c.command(script, ["--resume", c.runs / f"check-graphs-{stem}-{run}", flag_]), *c.device_flags]
        cmd += ["--checkpoint-every", "0"]
        resumed[run] = c.start(f"{name} {run}", cmd)
    for run, proc in resumed.items():
        code, out = c.finish(f"{name} {run}", proc)
        if code != 0:
            return c.failed(name, code, out, f"the {run} run exited {code}", f"{name} {run}")
    pairs = [("eager", "graphs"), ("resumed-eager", "resumed-graphs")]
    pairs += [("eager-2", "graphs-2"), ("eager-2", "graphs-flat-2")] if two_ranks else []
    for a, b in pairs:
        differ = checkpoint_differences(c.runs / f"check-graphs-{stem}-{a}", c.runs / f"check-graphs-{stem}-{b}")
        if differ:
            why = (
                f"{b} differs from {a} in {len(differ)} tensor(s), largest relative difference: {'; '.join(differ[:4])}"
            )
            return Result(name, "FAIL", why)
    two = " and 2 ranks (DDP, flat)" if two_ranks else ""
    return Result(
        name,
        "ok",
        f"--cudagraphs bitwise equal to eager at world size 1{two} (global step {total}), and resumed from global "
        f"step {stopped_at.group(1)} with and without it",
    )


def check_graphs(c: Check, script: str) -> Result:
    """`graphs:<script>`: --cudagraphs against eager from the same seeds (SAC's and TD3's runs, or the Atari ones)."""
    return (check_graphs_offpolicy if script in OFF_POLICY else check_graphs_atari)(c, script)


def check_graphs_speed(c: Check, script: str) -> Result:
    """`graphs-speed:<script>`: eager against --cudagraphs, steady SPS (SAC and TD3 on HalfCheetah-v5, or the Atari
    PPO at 8 envs)."""
    return (check_graphs_speed_offpolicy if script in OFF_POLICY else check_graphs_speed_atari)(c, script)


def check_nccl_guard(c: Check) -> Result:
    """NCCL with 2 ranks on one GPU: one line naming --backend gloo, before any process group (on the CPU, with
    --no-cuda: the line that NCCL needs CUDA)."""
    name = "nccl-guard"
    cmd = c.command(ATARI, ["--backend", "nccl", *c.device_flags, "--runs-dir", str(c.runs / "nccl")], nproc=2)
    code, out, _ = c.run(name, cmd)
    stem = ATARI.removesuffix(".py")
    errors = [line for line in out.splitlines() if line.startswith(f"{stem}: error:")]
    expected = "NCCL cannot put two ranks on one GPU" if c.device == "cuda" else "--backend nccl needs CUDA"
    if code in (0, None) or len(errors) != 1 or expected not in errors[0]:
        return c.failed(name, code, out, f"expected one line '{stem}: error: {expected} ...' and a non-zero exit")
    if f'cleanrl_ddp/{ATARI}", line' in out or (c.runs / "nccl").exists():
        return c.failed(name, code, out, "a traceback from the script, or a run directory: it got past its start")
    return Result(name, "ok", f"exit {code} with one line: {errors[0][len(stem) + 9 :][:90]}")


def check_evaluate(c: Check) -> list[Result]:
    """A checkpoint of the Atari PPO trained on the device (by `script:ppo_atari_multigpu.py`, else by `resume`,
    else by `script:ppo_atari_multigpu.py` run now), on the device and on the CPU (one thread); sampled actions, so
    that an untrained agent's games end (greedy, it may never press FIRE)."""
    results = []
    if ATARI not in c.trained:
        results.append(timed(check_script, c, ATARI))
        if results[-1].status != "ok":
            return [*results, Result("evaluate", "FAIL", f"no checkpoint to evaluate: script:{ATARI} failed")]
    for device in dict.fromkeys([c.device, "cpu"]):
        name = f"evaluate on {device}"
        cmd = [sys.executable, "-m", "cleanrl_ddp.evaluate", str(c.trained[ATARI]), "--episodes", "2", "--sample"]
        # on the CPU one thread: a batch of 2 frames gains nothing from more, and beside the other checks of its step
        # torch's 16 threads made it 49 s instead of about 10 (H200, 2026-11-26; docs/benchmarks.md)
        env = {**c.env, "OMP_NUM_THREADS": "1"} if device == "cpu" else None
        code, out, seconds = c.run(name, [*cmd, "--device", device], env=env)
        line = next((line for line in out.splitlines() if " return " in line and "±" in line), None)
        if code != 0 or line is None:
            results.append(c.failed(name, code, out))
        else:
            results.append(Result(name, "ok", line.split(": ", 1)[1][:110]))
        results[-1].seconds = seconds
    return results


def check_resume(c: Check) -> Result:
    """A 2-rank gloo run stopped by SIGTERM after its first checkpoint, resumed by `--resume` alone at world size 1
    with the replica check on: it ends at exactly the requested global step."""
    name = "resume"
    b = c.budget
    flags = shlex.split(b.resume_flags)
    total = b.resume_iterations * 2 * local_steps(b.resume_flags)
    run_dir = c.runs / "check-resume"
    cmd = c.command(ATARI, [*flags, "--total-timesteps", total, *c.device_flags, "--backend", "gloo"], nproc=2)
    cmd += ["--runs-dir", str(c.runs), "--run-name", run_dir.name, "--checkpoint-every", "1"]
    start = time.monotonic()
    proc = c.start(name, cmd)
    while not (run_dir / "checkpoint.pt").exists() and proc.poll() is None:
        if time.monotonic() - start > c.limit(name):
            break
        time.sleep(0.05)
    if proc.poll() is None and (run_dir / "checkpoint.pt").exists():
        os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards it to every rank
    code, out = c.finish(name, proc)
    stopped = re.search(r"preempted by a signal at global step (\d+);", out)
    if stopped is None:
        return c.failed(name, code, out, "the 2-rank run did not stop on SIGTERM with a checkpoint")
    stopped_step = int(stopped.group(1))
    resumed = f"{name} at world size 1"
    code, out, seconds = c.run(resumed, c.command(ATARI, ["--resume", run_dir, *c.device_flags]))
    if code != 0:
        return c.failed(name, code, out, f"the resume at world size 1 exited {code}", resumed)
    step, world_size = final_step(run_dir)
    if "world size 2 -> 1: global sizes kept" not in out or (step, world_size) != (total, 1):
        wrong = f"resumed to global step {step} at world size {world_size}, not {total} at 1"
        return c.failed(name, code, out, wrong, resumed)
    c.trained.setdefault(ATARI, run_dir)  # a checkpoint `evaluate` can read
    return Result(
        name,
        "ok",
        f"stopped at global step {stopped_step} of {total} (2 ranks, gloo), resumed on 1 rank "
        f"to exactly {total} in {seconds:.1f} s",
    )


THROUGHPUT = """
import json, sys
from benchmark import profile_rollout, throughput as tp
script, env_id, num_envs, num_steps, iterations, warmup, ceiling_steps, timeout, profiled, *extra = sys.argv[1:]
sizes = dict(local_num_envs=int(num_envs), num_steps=int(num_steps), extra=extra)
out = tp.run_once(script, env_id, 1, 1, [], sizes, int(iterations), float(timeout))
sps = tp.steady_sps(out["events"][tp.SPS_TAG], int(warmup))
update_share = tp.time_shares(out["events"], int(warmup))[0]
ceiling = tp.env_ceiling(script, env_id, 1, int(num_envs), int(ceiling_steps))
result = dict(sps=sps, ceiling=ceiling, update_share=update_share)
if int(profiled):
    module = "cleanrl_ddp." + script.rsplit("/", 1)[-1].removesuffix(".py")
    result["profile"] = profile_rollout.profile_iterations(module, env_id, int(num_envs), int(num_steps), int(profiled))
print("throughput:", json.dumps(result))
"""


def check_throughput(c: Check) -> list[Result]:
    """benchmark/throughput.py's steady SPS of the Atari PPO at world size 1 and the env-only ceiling, in this call."""
    b, results = c.budget, []
    for num_envs in b.throughput_envs:
        name = f"throughput {num_envs} envs"
        first = num_envs == b.throughput_envs[0]  # profiled too: where one iteration's time goes
        args = [num_envs, b.throughput_num_steps, b.throughput_iterations, b.throughput_warmup, b.ceiling_steps]
        args += [c.limit(name), b.profile_iterations if first else 0]
        cmd = [sys.executable, "-c", THROUGHPUT, str(REPO / "cleanrl_ddp" / ATARI), ENV_ID, *args]
        code, out, seconds = c.run(name, [*map(str, cmd), *c.device_flags])
        figures = re.search(r"^throughput: (.*)$", out, re.MULTILINE)
        if code != 0 or figures is None:
            results.append(c.failed(name, code, out))
            results[-1].seconds = seconds
            continue
        figures = json.loads(figures.group(1))
        sps, ceiling = figures["sps"], figures["ceiling"]
        goal = GOALS.get(num_envs)
        goal_text = f" (goal {100 * goal:.0f}%: {'met' if sps >= goal * ceiling else 'not met'})" if goal else ""
        figure = f"{ATARI} {sps:,.0f} SPS = {100 * sps / ceiling:.0f}% of the env-only ceiling {ceiling:,.0f} of this"
        figure += f" call{goal_text}; the update {100 * figures['update_share']:.0f}% of the time"
        results.append(Result(name, "ok", figure, seconds))
        if "profile" in figures:
            results.append(Result(f"profile {num_envs} envs", "ok", profile_figure(figures["profile"]), seconds))
        if first:
            results.append(timed(check_cleanrl, c, num_envs, sps))
            results.append(timed(check_leanrl_atari, c, num_envs, sps))
    return results


def profile_figure(profile: dict) -> str:
    """benchmark/profile_rollout.py's split of one iteration (each part timed to the device's end), as a line."""
    from benchmark.profile_rollout import PART_NAMES, PARTS

    total, parts = profile["total"], profile["seconds"]
    split = ", ".join(f"{PART_NAMES[p]} {1000 * parts[p]:.0f} ms ({100 * parts[p] / total:.0f}%)" for p in PARTS)
    return f"one iteration of {ATARI} alone, timed part by part: {1000 * total:.0f} ms = {split}"


def check_cleanrl(c: Check, num_envs: int, our_sps: float) -> Result:
    """CleanRL's own ppo_atari_multigpu.py (benchmark/peers/cleanrl_ppo_atari_multigpu.py, ported to gymnasium 1.x, or a
    checkout's) at 1 process x `num_envs` envs: it takes no --runs-dir, so it runs in a folder of its own and writes
    runs/<name> there; a checkout's `cleanrl_utils` comes from PYTHONPATH (the folder above the script's)."""
    name = f"cleanrl {num_envs} envs"
    if not c.cleanrl_script:
        return Result(name, "skip", "no --cleanrl-script (or CLEANRL_PPO_ATARI_MULTIGPU): CleanRL's script not run")
    from benchmark import throughput as tp
    from benchmark.events import read_scalar_events

    b, script = c.budget, Path(c.cleanrl_script).expanduser().resolve()
    if not script.is_file():
        return Result(name, "FAIL", f"--cleanrl-script {script}: no such file")
    workdir = c.out / "cleanrl"
    workdir.mkdir(exist_ok=True)
    total = b.cleanrl_iterations * num_envs * b.throughput_num_steps
    cmd = [sys.executable, str(script), "--env-id", ENV_ID, "--seed", "1", "--local-num-envs", str(num_envs)]
    cmd += ["--num-steps", str(b.throughput_num_steps), "--total-timesteps", str(total)]
    cmd += [] if c.device == "cuda" else ["--no-cuda"]
    env = {**c.env, "PYTHONPATH": os.pathsep.join([str(script.parent.parent), c.env["PYTHONPATH"]])}
    code, out, _ = c.run(name, cmd, env=env, cwd=workdir)
    run_dirs = sorted((workdir / "runs").glob("*")) if (workdir / "runs").is_dir() else []
    if code != 0 or not run_dirs:
        return c.failed(name, code, out)
    try:
        sps = tp.steady_sps(read_scalar_events(run_dirs[-1])[tp.SPS_TAG], b.throughput_warmup)
    except (KeyError, ValueError) as e:
        return c.failed(name, code, out, f"no steady charts/SPS: {e}")
    ratio = our_sps / sps
    met = "met" if ratio >= CLEANRL_GOAL else "not met"
    figure = f"CleanRL's {script.name} {sps:,.0f} SPS; {ATARI} {ratio:.2f}x of it"
    return Result(name, "ok", f"{figure} (goal {CLEANRL_GOAL:.0f}x: {met})")


def check_leanrl_atari(c: Check, num_envs: int, our_sps: float) -> Result:
    """LeanRL's own PPO Atari script (benchmark/peers/leanrl_ppo_atari.py, ported), `--compile --cudagraphs` on CUDA, at
    1 process x `num_envs` envs x the throughput's steps: its own steady speed (`speed: N sps`, from iteration 11
    to 20) next to `our_sps`, the Atari PPO's in the same call (goal: at least LeanRL's). It needs EnvPool (1.2.7:
    Python >= 3.12) with its Atari ROMs (benchmark/device_wheels.sh); without it, or without --leanrl-script, it is
    skipped with one line."""
    import importlib.util

    name = f"leanrl {num_envs} envs"
    if not c.leanrl_script:
        return Result(name, "skip", "no --leanrl-script: LeanRL's script not run")
    if importlib.util.find_spec("envpool") is None:
        return Result(name, "skip", "no envpool here (EnvPool 1.2.7 needs Python >= 3.12: benchmark/device_wheels.sh)")
    b, script = c.budget, Path(c.leanrl_script).expanduser().resolve()
    if not script.is_file():
        return Result(name, "FAIL", f"--leanrl-script {script}: no such file")
    workdir = c.out / "leanrl_ppo_atari"
    workdir.mkdir(exist_ok=True)
    total = b.leanrl_iterations * num_envs * b.throughput_num_steps
    cmd = [sys.executable, str(script), "--num-envs", str(num_envs), "--num-steps", str(b.throughput_num_steps)]
    cmd += ["--total-timesteps", str(total)] + (["--compile", "--cudagraphs"] if c.device == "cuda" else ["--no-cuda"])
    code, out, _ = c.run(name, cmd, cwd=workdir)
    speeds = re.findall(r"speed: *([\d.]+) sps", out)
    if code != 0 or not speeds:
        return c.failed(name, code, out, "" if code != 0 else "no `speed: N sps` in its output")
    sps, mode = float(speeds[-1]), "--compile --cudagraphs" if c.device == "cuda" else "eager"
    met = "met" if our_sps >= LEANRL_GOAL * sps else "not met"
    figure = f"LeanRL's {script.name} ({mode}) {sps:,.0f} SPS; {ATARI} {our_sps / sps:.2f}x of it (goal 1x: {met})"
    return Result(name, "ok", figure)


def check_env_sweep(c: Check, num_envs: str) -> Result:
    """The env layer alone (issue 41, item 3): `python -m benchmark.throughput --env-sweep N`, the random-action rate
    of ALE's vector env built by the Atari PPO's make_env for each num_threads and batch_size; its best settings."""
    name = f"env-sweep:{num_envs}"
    cmd = [sys.executable, "-m", "benchmark.throughput", "--script", str(REPO / "cleanrl_ddp" / ATARI)]
    cmd += ["--env-id", ENV_ID, "--env-sweep", num_envs, "--env-sweep-steps", str(c.budget.env_sweep_steps)]
    code, out, seconds = c.run(name, cmd)
    best = re.search(r"^env-sweep \d+ envs best: (.*)$", out, re.MULTILINE)
    if code != 0 or best is None:
        return c.failed(name, code, out)
    return Result(name, "ok", best.group(1), seconds)


CHECKS = {"script": check_script, "gloo": check_gloo, "flat": check_flat, "compile": check_compile}
CHECKS |= {"compile-flat": check_compile_flat, "compile-speed": check_compile_speed, "sync-debug": check_sync_debug}
CHECKS |= {"nccl-1": check_nccl_one, "nccl-guard": check_nccl_guard, "resume": check_resume}
CHECKS |= {"evaluate": check_evaluate, "throughput": check_throughput, "env-sweep": check_env_sweep}
CHECKS |= {"profile": check_profile, "graphs": check_graphs, "graphs-speed": check_graphs_speed, "leanrl": check_leanrl}


def timed(check, c: Check, *args) -> Result:
    """`check(c, *args)`, with its seconds where the check did not set them."""
    start = time.monotonic()
    result = check(c, *args)
    if not result.seconds:
        result.seconds = time.monotonic() - start
    return result


def run_check(c: Check, name: str) -> None:
    """Run check `name` (`kind:script` or a single check) and report each of its results as it comes."""
    kind, _, script = name.partition(":")
    start = time.monotonic()
    try:
        results = CHECKS[kind](c, *([script] if script else []))
    except InterruptedError:
        return
    except Exception as e:  # a check that broke (a missing file, ...): its line, and the next check
        results = Result(name, "FAIL", f"the check itself failed: {type(e).__name__}: {e}")
    for result in results if isinstance(results, list) else [results]:
        if not result.seconds:
            result.seconds = time.monotonic() - start
        c.report(result)


def within_budget(c: Check, step: list[str], budget: float, elapsed: float) -> list[str]:
    """The checks of `step` whose estimate ends within `budget` seconds (all, when it is 0); each other one is
    reported as a skip line that says so."""
    if not budget:
        return step
    fits = [name for name in step if elapsed + estimate(name) <= budget]
    for name in step:
        if name not in fits:
            why = f"not started: about {estimate(name):.0f} s would end past the budget of {budget:.0f} s"
            c.report(Result(name, "skip", f"{why} ({elapsed:.0f} s gone; --budget, --only)"))
    return fits


def step_env(env: dict, step: list[str]) -> dict:
    """The environment of a step's commands: the checks of a step run at once, a few processes each, so each
    process has one thread (OMP_NUM_THREADS=1: the scripts' own thread rule gives each all the cores; on the H200,
    2026-11-26, 16 threads in each of some 30 processes on 16 cores held three scripts past their 90 s limit, 9 s
    each alone); a check alone in its step (a speed measurement) has the machine and the scripts' own rule."""
    return {**env, "OMP_NUM_THREADS": "1"} if len(step) > 1 else env


def machine(device: str) -> str:
    import torch

    cores = len(os.sched_getaffinity(0))
    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}, {cores} cores"
    return f"{platform.processor() or platform.machine()} CPU, torch {torch.__version__}, {cores} cores"


def count(summary: Path) -> dict:
    lines = summary.read_text().splitlines()
    return {s: sum(line.startswith(f"{s} ") for line in lines) for s in ("ok", "FAIL", "skip")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmark.gpu_check",
        description=__doc__.split("\n\n")[0],
        epilog=f"checks: {', '.join(PER_SCRIPT)} (each as <check>:<script>), {', '.join(SINGLE)}, env-sweep:<envs>",
    )
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument(
        "--quick", action="store_true", help=f"the quick profile (the default): within --budget ({QUICK_BUDGET} s)"
    )
    profile.add_argument("--full", action="store_true", help="every check, one at a time: about 20-30 minutes")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: the checks on the CPU at tiny sizes, as the CPU test runs them (default: cuda)",
    )
    parser.add_argument(
        "--cleanrl-script",
        default=os.environ.get("CLEANRL_PPO_ATARI_MULTIGPU"),
        help="CleanRL's ppo_atari_multigpu.py to measure next to ours: benchmark/peers/cleanrl_ppo_atari_multigpu.py "
        "(ported to gymnasium 1.x) or a CleanRL checkout's (default: $CLEANRL_PPO_ATARI_MULTIGPU; else skipped)",
    )
    parser.add_argument(
        "--leanrl-script",
        help="LeanRL's PPO Atari script, benchmark/peers/leanrl_ppo_atari.py, to measure next to ours with --compile "
        "--cudagraphs (needs EnvPool: benchmark/device_wheels.sh; skipped without it or without this flag)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help=f"seconds: a check starts only if its estimate (ESTIMATES) ends within them, else it is a skip line "
        f"(default: {QUICK_BUDGET} for the quick profile on CUDA, else none; 0: none)",
    )
    for algo, script in (("sac", SAC), ("td3", TD3)):
        parser.add_argument(
            f"--leanrl-{algo}-script",
            default=os.environ.get(f"LEANRL_{algo.upper()}_SCRIPT"),
            help=f"LeanRL's {algo} script ported to today's packages (benchmark/leanrl_{algo}_continuous_action.py; "
            f"needs torchrl), to measure next to {script} in the leanrl check (--full; default: "
            f"$LEANRL_{algo.upper()}_SCRIPT; skipped when neither is set)",
        )
    parser.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks of the profile")
    parser.add_argument(
        "--out",
        type=Path,
        help="an empty or new folder for summary.txt, logs/ and runs/ (default: gpu_check/<UTC time> in the "
        "system's temporary folder)",
    )
    args = parser.parse_args(argv)
    steps = full_profile() if args.full else quick_profile()
    in_profile = {name for step in steps for name in step}
    for o in args.only or []:
        if o not in in_profile:
            known = f"{', '.join(PER_SCRIPT)} as <check>:<script> for one of {', '.join(scripts())}"
            known += f"; {', '.join(SINGLE)}; env-sweep:<envs>"
            where = "" if args.full or o not in {n for s in full_profile() for n in s} else " (it is in --full)"
            parser.error(f"--only {o}: not a check of this profile{where}; the checks are {known}")
    if args.only:
        steps = [[name for name in step if name in args.only] for step in steps]
        steps = [step for step in steps if step]

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing checked")
        return 0
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = args.out or Path(tempfile.gettempdir()) / "gpu_check" / stamp
    if out.exists() and any(out.iterdir()):  # a run directory there would be resumed, not started
        parser.error(f"--out {out} is not empty")
    budget = GPU_BUDGET if args.device == "cuda" else CPU_BUDGET
    leanrl = {SAC: args.leanrl_sac_script, TD3: args.leanrl_td3_script}
    c = Check(args.device, budget, out, args.cleanrl_script, args.leanrl_script, leanrl)
    seconds = args.budget if args.budget is not None else QUICK_BUDGET if not args.full and args.device == "cuda" else 0
    start = time.monotonic()
    profile_name = "full" if args.full else "quick"
    header = f"gpu_check --{profile_name} on {args.device}: {machine(args.device)}; "
    header += time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    append(c.summary, header)
    print(header, flush=True)
    running = {}  # future -> check name

    def stop(signum, frame):
        with c.lock:
            c.stopping = True
        left = kill_marked(c.marker)
        unfinished = ", ".join(sorted(running.values())) or "none"
        line = f"gpu_check: interrupted by {signal.Signals(signum).name} after {time.monotonic() - start:.0f} s"
        unfinished += f"; still running after SIGKILL: {left}" if left else ""
        with c.lock:
            append(c.summary, f"{line}; unfinished: {unfinished}")
        print(f"{line}; unfinished: {unfinished}", flush=True)
        os._exit(128 + signum)  # the threads wait on processes that are gone: nothing of theirs is left to report

    base_env = c.env
    handlers = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    with ThreadPoolExecutor(max_workers=max(map(len, steps))) as pool:
        for step in steps:
            step = within_budget(c, step, seconds, time.monotonic() - start)
            c.env = step_env(base_env, step)
            running.update({pool.submit(run_check, c, name): name for name in step})
            while running:
                done, _ = wait(list(running), timeout=0.5, return_when=FIRST_COMPLETED)
                for future in done:
                    running.pop(future)
    for signum, handler in handlers.items():  # as they were (a test calls main() in its own process)
        signal.signal(signum, handler)
    counts = count(c.summary)
    over = sum(" past the budget of " in line for line in c.summary.read_text().splitlines())
    line = (
        f"gpu_check: {counts['ok']} ok, {counts['FAIL']} FAIL, {counts['skip']} skipped"
        f"{f' ({over} for the budget of {seconds:.0f} s)' if over else ''} in "
        f"{(time.monotonic() - start) / 60:.1f} min; logs in {c.logs}"
    )
    append(c.summary, line)
    print(line)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
