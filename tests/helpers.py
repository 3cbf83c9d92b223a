"""Launch scripts through their real command lines and read what they wrote (shared by all tests)."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from benchmark.events import event_files, read_scalar_events, read_scalars  # noqa: F401 (re-exported)

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "cleanrl_ddp"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` entry point, same interpreter


def script_path(script: str) -> str:
    return str(SCRIPTS / script)


def launch(script, args=(), nproc=1, timeout=300, env=None, torchrun_args=None, cwd=None, wrapper=()):
    """Run `script` with `args`: plain python when nproc == 0, else `torchrun --standalone`.

    `wrapper` (a program and its leading arguments, e.g. tests/dist_worker.py) is launched instead,
    with the script's path and `args` after its own. Returns the CompletedProcess (text, stdout and
    stderr captured). Never waits past `timeout`.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", **(env or {})}
    program = [*(str(w) for w in wrapper), script_path(script)]
    if nproc == 0:
        cmd = [sys.executable, *program]
    else:
        launcher = ["--standalone", f"--nproc_per_node={nproc}"] if torchrun_args is None else torchrun_args
        cmd = [*TORCHRUN, *launcher, *program]
    cmd += [str(a) for a in args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)


def free_port() -> int:
    """A TCP port that was free a moment ago (for torchrun's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dirs(runs_dir) -> list[Path]:
    return sorted(p for p in Path(runs_dir).iterdir() if p.is_dir())


def only_run_dir(runs_dir) -> Path:
    dirs = run_dirs(runs_dir)
    assert len(dirs) == 1, f"expected one run directory in {runs_dir}, found {dirs}"
    return dirs[0]


def assert_one_line_error(proc, pattern: str, script: str) -> None:
    """The run failed with our one-line error, printed once (rank 0), and no traceback from the script."""
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    stem = script.removesuffix(".py")
    lines = [line for line in output.splitlines() if line.startswith(f"{stem}: error:")]
    assert len(lines) == 1, output
    assert re.search(pattern, lines[0]), lines[0]
    assert f'cleanrl_ddp/{script}", line' not in output, output  # no traceback into our code
