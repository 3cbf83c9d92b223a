"""Launch scripts through their real command lines and read what they wrote (shared by all tests)."""

import hashlib
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from benchmark.events import event_files, read_scalar_events, read_scalars  # noqa: F401 (re-exported)
from cleanrl_ddp import runtime as rt

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "cleanrl_ddp"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` entry point, same interpreter
# what a launcher sets, and what a script reads as its rank, world size, job and restart
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_PROCID")
LAUNCH_VARS += ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS")


def script_path(script: str) -> str:
    return str(SCRIPTS / script)


def command(script, args=(), nproc=1, env=None, torchrun_args=None, wrapper=()) -> tuple[list[str], dict]:
    """The command line and environment that `launch` and `start` run."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", **(env or {})}
    program = [*(str(w) for w in wrapper), *([script_path(script)] if script else [])]
    if nproc == 0:
        cmd = [sys.executable, *program]
    else:
        launcher = ["--standalone", f"--nproc_per_node={nproc}"] if torchrun_args is None else torchrun_args
        cmd = [*TORCHRUN, *launcher, *program]
    return cmd + [str(a) for a in args], full_env


def launch(script, args=(), nproc=1, timeout=300, env=None, torchrun_args=None, cwd=None, wrapper=()):
    """Run `script` with `args`: plain python when nproc == 0, else `torchrun --standalone`.

    `wrapper` (a program and its leading arguments, e.g. tests/dist_worker.py) is launched instead,
    with the script's path (none when `script` is None) and `args` after its own. Returns the
    CompletedProcess (text, stdout and stderr captured). Never waits past `timeout`.
    """
    cmd, full_env = command(script, args, nproc, env, torchrun_args, wrapper)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)


def batch_job(script: str, args, outdir: Path, mode="plain", global_envs=0) -> dict:
    """One run of `launch_batch`: `script` with `args` (tests/observed_runs.py says what `mode` records)."""
    args = [str(a) for a in args]
    return dict(mode=mode, script=script_path(script), args=args, outdir=str(outdir), global_envs=global_envs)


def launch_batch(jobs: list, nproc: int, jobs_file: Path, timeout: float, start_only=False, **kw):
    """Run the `batch_job`s one after another in one launch of `nproc` ranks (0: plain python), each in a process
    group of its own, so that the ranks start once for all (tests/dist_worker.py's `batch`). Each job's exit code is
    in its outdir's `exit{R}` (`batch_exit_codes`), what it printed in `output{R}`. Returns the CompletedProcess;
    with `start_only`, the Popen at once, as `start` does."""
    jobs_file.write_text(json.dumps(jobs))
    wrapper = [REPO / "tests" / "dist_worker.py", "batch", jobs_file]
    if start_only:
        return start(None, nproc=nproc, wrapper=wrapper, **kw)
    return launch(None, nproc=nproc, timeout=timeout, wrapper=wrapper, **kw)


def batch_exit_codes(outdir: Path, world_size: int) -> list:
    """The exit code of a `batch_job` on each rank (None where it did not end)."""
    exits = [Path(outdir) / f"exit{r}" for r in range(world_size)]
    return [int(e.read_text()) if e.exists() else None for e in exits]


def batch_output(outdir: Path, world_size: int) -> str:
    """What a `batch_job` printed, rank 0's first (nothing of a rank whose run never began)."""
    outputs = [Path(outdir) / f"output{r}" for r in range(world_size)]
    return "".join(o.read_text() for o in outputs if o.exists())


def start(script, args=(), nproc=1, env=None, torchrun_args=None, cwd=None, wrapper=(), **popen_kwargs):
    """Start `script` like `launch` but return at once (the Popen), in its own process group (for fault injection).

    Finish with `finish(proc, timeout)`, which never waits past `timeout` and kills the whole group.
    """
    cmd, full_env = command(script, args, nproc, env, torchrun_args, wrapper)
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd or REPO,
        start_new_session=True,
        **popen_kwargs,
    )


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a `start`ed process; past `timeout`, kill its process group and fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout} s:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def child_pids(pid: int) -> list[int]:
    """The direct children of process `pid`; torchrun's workers in local-rank order, read from the LOCAL_RANK that
    each one started with (process ids do not grow with the rank once the kernel's counter wraps around)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]

    def local_rank(child: int) -> tuple[int, int]:
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        ranks = [int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"LOCAL_RANK=")]
        return (ranks[0] if ranks else -1, child)

    return sorted(children, key=local_rank)


def wait_until(condition, timeout: float, proc: subprocess.Popen | None = None, what: str = "condition") -> None:
    """Poll `condition()` until true; fail after `timeout` s, or at once if `proc` exited first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}:\n{proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.05)


def free_port() -> int:
    """A TCP port that was free a moment ago (for torchrun's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dirs(runs_dir) -> list[Path]:
    return sorted(p for p in Path(runs_dir).iterdir() if p.is_dir())


def file_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def only_run_dir(runs_dir) -> Path:
    dirs = run_dirs(runs_dir)
    assert len(dirs) == 1, f"expected one run directory in {runs_dir}, found {dirs}"
    return dirs[0]


@contextmanager
def as_one_rank(monkeypatch, script: str, *flags, env=None):
    """`script`'s main() to call in this process as one rank with `flags` (the launcher's variables removed, `env`
    set); the signal handlers and thread count that main() sets are put back afterwards. A process of its own costs
    about 5 CPU-seconds here (importing torch, and what its optimizers import), more than a tiny run."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in (env or {}).items():
        monkeypatch.setenv(var, value)
    module = importlib.import_module(f"cleanrl_ddp.{script.removesuffix('.py')}")
    monkeypatch.setattr(sys, "argv", [script, *map(str, flags)])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    threads = torch.get_num_threads()
    try:
        yield module.main
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.set_num_threads(threads)


def main_error(monkeypatch, script: str, *flags, env=None) -> str:
    """The RunError that `script`'s main() raises with `flags`, in this process as one rank (`as_one_rank`). A bad
    input needs no process of its own: `rt.exit_codes` prints every RunError as one line with its exit code
    (tests/test_runtime.py), and one case per test file also runs as a command."""
    from cleanrl_ddp.runtime import RunError

    with as_one_rank(monkeypatch, script, *flags, env=env) as main, pytest.raises(RunError) as error:
        main()
    return str(error.value)


def main_exit(monkeypatch, capsys, script: str, *flags) -> tuple[int, str]:
    """The exit code and stderr of `script`'s __main__ block (`rt.exit_codes` around main()) with `flags`, in this
    process as one rank (`as_one_rank`): exit_codes leaves by os._exit, here turned into SystemExit."""
    from cleanrl_ddp import runtime as rt

    monkeypatch.setattr(os, "_exit", sys.exit)
    capsys.readouterr()
    with as_one_rank(monkeypatch, script, *flags) as main, pytest.raises(SystemExit) as leave:
        with rt.exit_codes(script.removesuffix(".py")):
            main()
    return leave.value.code, capsys.readouterr().err


def main_output(monkeypatch, capsys, script: str, *flags) -> str:
    """What `script`'s main() prints with `flags`, run to its end in this process as one rank (`as_one_rank`): a
    run whose command line is not what a test is about (the plain-python command: the same variables unset)."""
    capsys.readouterr()
    with as_one_rank(monkeypatch, script, *flags) as main:
        main()
    return capsys.readouterr().out


def assert_one_line_error(proc, pattern: str, script: str) -> None:
    """The run failed with our one-line error, printed once (rank 0), and no traceback from the script."""
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    stem = script.removesuffix(".py")
    lines = [line for line in output.splitlines() if line.startswith(f"{stem}: error:")]
    assert len(lines) == 1, output
    assert re.search(pattern, lines[0]), lines[0]
    assert f'cleanrl_ddp/{script}", line' not in output, output  # no traceback into our code


def wandb_offline_runs(wandb_dir) -> list[dict]:
    """The offline W&B runs under `wandb_dir` (the WANDB_DIR of a launch): dict(id, config) per run.

    Read from each run's `run-*.wandb` file: a LevelDB-style log (a 7-byte W&B header, then 32 KiB
    blocks of records with a 7-byte header each) of protobuf `Record`s; the `run` record holds the config.
    """
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunks = path.read_bytes(), 7, []
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if left < 7 or (kind == 0 and length == 0):  # block trailer or padding
                pos += left
                continue
            chunks.append(data[pos + 7 : pos + 7 + length])
            pos += 7 + length
            if kind in (1, 4):  # a FULL record, or the LAST piece of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(b"".join(chunks))
                chunks = []
                if record.WhichOneof("record_type") == "run":
                    config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
                    runs.append(dict(id=record.run.run_id, config=config))
    return runs


@dataclass
class Args(rt.RunArgs):
    """What a script's Args adds that the run module reads: the run name's parts, the budget, per-rank sizes (for the
    unit tests of runtime.py and run_dir.py)."""

    env_id: str = "ALE/Pong-v5"
    exp_name: str = "test"
    seed: int = 1
    total_timesteps: int = 1000
    local_num_envs: int = 1


def single_run(tmp_path, **flags) -> rt.Run:
    """A world-size-1 run on the CPU with `Args(runs_dir=tmp_path, **flags)`, as `rt.start` would make it."""
    return rt.Run("ppo_multigpu", Args(runs_dir=str(tmp_path), **flags), 0, 1, torch.device("cpu"), None)
