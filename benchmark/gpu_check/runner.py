"""How the checks run: each command a process marked as gpu_check's (found and killed by the marker in its
environment, torchrun's ranks in sessions of their own too), its output streamed to OUT/logs/<check>.log, each
check's line appended to OUT/summary.txt the moment it ends; the steps one after another within the budget, the
checks of a step at once, and a stop on SIGTERM, SIGINT or SIGHUP that kills every process it started."""

import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from benchmark.gpu_check import plan
from benchmark.gpu_check.sizes import REPO, Sizes

MARKER = "GPU_CHECK_RUN"  # in the environment of every process a check starts: how they are all found and killed
KILL_SECONDS = 5  # how long SIGKILL may take to end every marked process (then gpu_check names the ones left)


@dataclass
class Result:
    name: str
    status: str  # "ok", "FAIL" or "skip"
    figure: str
    seconds: float = 0.0

    def line(self) -> str:
        return f"{self.status:<5} {self.name}: {self.figure} [{self.seconds:.0f} s]"


class Check:
    """Where the checks run: the device, their sizes, the output folder, the runs they share, and every process
    they started (found by the marker in its environment)."""

    def __init__(self, device: str, sizes: Sizes, out: Path, cleanrl_script=None, leanrl_script=None, leanrl=None):
        self.device, self.sizes, self.out, self.cleanrl_script = device, sizes, out, cleanrl_script
        self.leanrl_script = leanrl_script  # LeanRL's PPO Atari (peers/leanrl_ppo_atari.py), by `throughput`
        self.leanrl_scripts = leanrl or {}  # SAC/TD3 -> LeanRL's script ported (benchmark/peers/leanrl_*.py)
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
        return self.sizes.timeouts[re.split(r"[: ]", name)[0]]

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


def timed(check, c: Check, *args) -> Result:
    """`check(c, *args)`, with its seconds where the check did not set them."""
    start = time.monotonic()
    result = check(c, *args)
    if not result.seconds:
        result.seconds = time.monotonic() - start
    return result


def run_check(c: Check, name: str, checks: dict) -> None:
    """Run check `name` (`kind:script` or a single check, its function in `checks` by kind) and report each of its
    results as it comes."""
    kind, _, script = name.partition(":")
    start = time.monotonic()
    try:
        results = checks[kind](c, *([script] if script else []))
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
    fits = [name for name in step if elapsed + plan.estimate(name) <= budget]
    for name in step:
        if name not in fits:
            why = f"not started: about {plan.estimate(name):.0f} s would end past the budget of {budget:.0f} s"
            c.report(Result(name, "skip", f"{why} ({elapsed:.0f} s gone; --budget, --only)"))
    return fits


def step_env(env: dict, step: list[str]) -> dict:
    """The environment of a step's commands: the checks of a step run at once, a few processes each, so each
    process has one thread (OMP_NUM_THREADS=1: the scripts' own thread rule gives each all the cores; on an H200,
    16 threads in each of some 30 processes on 16 cores held three scripts past their 90 s limit, 9 s each alone);
    a check alone in its step (a speed measurement) has the machine and the scripts' own rule."""
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


def run_steps(c: Check, steps: list[list[str]], checks: dict, budget: float, header: str) -> int:
    """The steps one after another, the checks of a step at once, within `budget` seconds (0: none); the summary's
    header and last line; exit 1 when a check failed. A signal kills every process the checks started, writes
    which checks were unfinished, and exits 128 + its number."""
    start = time.monotonic()
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
            step = within_budget(c, step, budget, time.monotonic() - start)
            c.env = step_env(base_env, step)
            running.update({pool.submit(run_check, c, name, checks): name for name in step})
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
        f"{f' ({over} for the budget of {budget:.0f} s)' if over else ''} in "
        f"{(time.monotonic() - start) / 60:.1f} min; logs in {c.logs}"
    )
    append(c.summary, line)
    print(line)
    return 1 if counts["FAIL"] else 0
