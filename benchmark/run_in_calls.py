"""Run one long training run in pieces, each within a wall-clock limit: start or resume the run, stop it cleanly
before the limit, and leave its run directory where the next piece finds it, on this machine or, packed, on another.

A job whose time limit is shorter than the run (SLURM's --time, a spot instance that may be reclaimed, a machine
booked by the hour) runs one piece. SIGTERM goes to the run --margin seconds before --minutes are up; the run
checkpoints at the end of its iteration and exits 75; the next piece, the same command, resumes from the checkpoint:

    python -m benchmark.run_in_calls --minutes 55 --script cleanrl_ddp/ppo_atari_multigpu.py \
        --env-id BreakoutNoFrameskip-v4 --seed 1 -- --local-num-envs 8

Set --minutes a little under the job's limit. Without --minutes a piece runs until the run finishes, or until this
process gets SIGTERM or SIGINT, which it passes on to the run as at the deadline (a spot instance's notice, Ctrl-C).

Nodes without shared storage: --out DIR packs the run directory at the end of the piece into
DIR/{run name}.tgz.part0 (and .part1, ... with --part-mib, for a transfer that limits a file's size), and the next
piece, on another machine, unpacks the parts it is given with --carried:

    python -m benchmark.run_in_calls --minutes 55 --out /tmp/out --script ...                 # machine A
    # copy /tmp/out/{run name}.* to machine B's runs/carry/, then on B, with the same flags:
    python -m benchmark.run_in_calls --minutes 55 --out /tmp/out --carried runs/carry --script ...

Each piece appends one line to {run dir}/pieces.jsonl: start and end (UTC), global steps from and to, the
machine (and GPU), package versions, the commit of the script's checkout, exit code, outcome and the exact command;
its output is kept as {run dir}/piece{N}.log. `python -m benchmark.harness report` draws each piece on the run's
curve, finished or not, and lists every piece in its pieces.csv.
The run's command is the harness's (`benchmark/harness.py`: `--env-id`, `--seed`, `--runs-dir`, `--run-name`
appended, torchrun above world size 1), so a run's name is the one a harness grid gives it.
"""

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmark.harness import PIECES_FILE, RUNNING_FILE, config_name, portable, run_command, run_name, utc
from benchmark.versions import package_versions, source_commit

PACK_SECONDS = 5  # before the deadline: a run still going is killed (its last checkpoint stays), then packed
PREEMPTED_LINE = "preempted by a signal at global step"  # rank 0's line after a checkpoint and exit 75 (runtime.py)


def checkpoint_step(run_dir: Path):
    """(global step, total timesteps) of the run's checkpoint, or (0, None) before its first one."""
    path = run_dir / "checkpoint.pt"
    if not path.is_file():
        return 0, None
    from cleanrl_ddp.checkpoint import read_checkpoint  # torch: imported only where there is a checkpoint to read

    ckpt = read_checkpoint(str(path))
    return int(ckpt["global_step"]), int(ckpt["args"]["total_timesteps"])


def flags_total(run_dir: Path):
    """The --total-timesteps the run directory's flags.json holds (written when the run made the directory)."""
    flags = run_dir / "flags.json"
    return json.loads(flags.read_text())["args"]["total_timesteps"] if flags.is_file() else None


def machine() -> str:
    """The host, its CPUs and, where there is one, the GPU that nvidia-smi names."""
    text = f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})"
    try:
        gpus = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        ).stdout.split("\n")
    except (OSError, subprocess.TimeoutExpired):
        gpus = []
    gpus = [g.strip() for g in gpus if g.strip()]
    return text + (f", {len(gpus)} x {gpus[0]}" if gpus else "")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers run in sessions of their own), from /proc."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def unpack(carried: Path, name: str, runs_dir: Path) -> Path:
    """Rebuild the run directory from the parts a previous piece packed, under runs_dir."""
    parts = sorted(carried.glob(f"{name}.tgz.part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
    if not parts:
        raise SystemExit(f"run_in_calls: error: {carried} holds no {name}.tgz.part*: nothing to resume from")
    run_dir = runs_dir / name
    if run_dir.exists():
        raise SystemExit(f"run_in_calls: error: {run_dir} exists here already; --carried would replace it")
    archive = runs_dir / f"{name}.tgz"
    with open(archive, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    with tarfile.open(archive) as tar:
        if any(not (m.name == name or m.name.startswith(f"{name}/")) for m in tar.getmembers()):
            raise SystemExit(f"run_in_calls: error: {archive} holds files outside {name}/")
        tar.extractall(runs_dir, filter="data")
    archive.unlink()
    return run_dir


def pack(run_dir: Path, out: Path, part_bytes: int | None = None) -> list[Path]:
    """The run directory as {name}.tgz.part0 under `out` (with part_bytes: .part0, .part1, ... of at most that
    size): what the next piece, elsewhere, unpacks with --carried."""
    out.mkdir(parents=True, exist_ok=True)
    archive = out / f"{run_dir.name}.tgz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:  # weights barely compress: be fast
        tar.add(run_dir, arcname=run_dir.name, filter=lambda m: None if m.name.endswith("/lease") else m)
    data, parts = archive.read_bytes(), []
    archive.unlink()
    size = part_bytes or max(len(data), 1)
    for i in range(0, max(len(data), 1), size):
        parts.append(out / f"{run_dir.name}.tgz.part{i // size}")
        parts[-1].write_bytes(data[i : i + size])
    return parts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", required=True, help="the script, e.g. cleanrl_ddp/ppo_atari_multigpu.py")
    parser.add_argument("--env-id", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=1, help="processes (torchrun above 1)")
    parser.add_argument("--label", default=None, help="the configuration's name in the run name (default ws{N})")
    parser.add_argument("--runs-dir", default="runs/calls", help="where the run directory is (or is unpacked)")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="this piece's wall-clock limit (a little under the job's); default none",
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=60.0,
        help=f"seconds before the end of --minutes at which to send SIGTERM; a run still going {PACK_SECONDS} s "
        "before the end is killed (its last periodic checkpoint stays)",
    )
    parser.add_argument("--out", default=None, help="pack the run directory into this folder at the end, to move it")
    parser.add_argument(
        "--part-mib", type=float, default=None, help="with --out: split the archive into parts of this size"
    )
    parser.add_argument("--carried", default=None, help="a folder holding the parts a previous piece packed")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- then the script's own flags")
    args = parser.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    start_wall, start = time.time(), time.monotonic()
    deadline = None if args.minutes is None else start + 60 * args.minutes
    part_bytes = None if args.part_mib is None else int(args.part_mib * 2**20)
    if part_bytes is not None and part_bytes < 1:
        parser.error(f"--part-mib must be positive, got {args.part_mib}")
    if not Path(args.script).is_file():
        parser.error(f"--script {args.script}: no such file")
    if args.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {args.world_size}")
    if args.margin <= PACK_SECONDS:
        parser.error(f"--margin must leave the run time to checkpoint: more than {PACK_SECONDS} s")
    if deadline is not None and 60 * args.minutes <= args.margin:
        parser.error(f"--minutes {args.minutes} leaves no time to run before the --margin of {args.margin:.0f} s")

    runs_dir = Path(args.runs_dir)
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--runs-dir {runs_dir}: {e.strerror}")
    name = run_name(args.script, args.env_id, args.world_size, args.seed, args.label)
    run_dir = unpack(Path(args.carried), name, runs_dir) if args.carried else runs_dir / name
    records, running = run_dir / PIECES_FILE, run_dir / RUNNING_FILE
    pieces = [json.loads(line) for line in records.read_text().splitlines()] if records.is_file() else []
    if pieces and pieces[-1]["outcome"] == "finished":
        print(f"run_in_calls: {run_dir} has finished (piece {len(pieces)}): nothing to run")
        return 0
    step_from, total = checkpoint_step(run_dir)
    if pieces and not (run_dir / "checkpoint.pt").is_file():
        raise SystemExit(
            f"run_in_calls: error: {run_dir} has {len(pieces)} piece(s) but no checkpoint.pt to resume (none reached "
            "its first checkpoint): start the run afresh, without --carried"
        )
    if running.is_file():  # a piece whose run_in_calls died (SIGKILL, a reboot): it ran to the last checkpoint
        lost = json.loads(running.read_text())
        ended = (run_dir / "checkpoint.pt").stat().st_mtime if step_from else lost["start_time"]
        lost |= dict(end=utc(ended), end_time=ended, step_to=step_from, versions={}, exit_code=None)
        pieces.append(lost | dict(outcome="interrupted"))
        with open(records, "a") as f:
            f.write(json.dumps(pieces[-1]) + "\n")
        running.unlink()

    cmd = run_command(args.script, args.env_id, args.seed, args.world_size, str(runs_dir), extra, args.label)
    cmd += ["--resume", str(run_dir)] if step_from else []
    piece = len(pieces) + 1
    log_path = runs_dir / f"{name}.piece{piece}.log"  # moved into the run directory once the run has made it
    record = dict(piece=piece, name=name, script=args.script, env_id=args.env_id, seed=args.seed)
    record |= dict(world_size=args.world_size, label=args.label, config=config_name(args.world_size, args.label))
    record |= dict(start=utc(start_wall), start_time=start_wall, step_from=step_from, total_timesteps=total)
    record |= dict(machine=machine(), command=shlex.join(cmd), portable_command=portable(shlex.join(cmd)))
    record |= dict(log=f"piece{piece}.log", commit=source_commit(os.path.dirname(os.path.abspath(args.script))))
    record |= dict(versions=package_versions())  # the piece's, named in the report while it runs too
    print(f"run_in_calls: piece {piece} of {name}, from step {step_from}: {shlex.join(cmd)}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    signalled = []  # when this process sent SIGTERM: at the deadline, or passing on its own SIGTERM or SIGINT

    def stop(*_):
        if not signalled and proc.poll() is None:
            signalled.append(time.monotonic())
            proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its workers; each saves and exits 75

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    killed = False
    while proc.poll() is None:
        now = time.monotonic()
        if not running.is_file() and (run_dir / "flags.json").is_file():  # the piece in progress, for the report
            total = total or flags_total(run_dir)
            running.write_text(json.dumps(record | dict(total_timesteps=total, outcome="running")))
        if deadline is not None and not signalled and now >= deadline - args.margin:
            print(f"run_in_calls: {args.margin:.0f} s before the deadline: SIGTERM", flush=True)
            stop()
        if deadline is not None and now >= deadline - PACK_SECONDS:  # too late for a checkpoint: the last stays
            for pid in [proc.pid, *descendants(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed = True
            proc.wait()
            break
        try:
            proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
    code = proc.returncode
    end_wall = time.time()

    text = log_path.read_text(errors="replace")
    if run_dir.is_dir():
        log_path = Path(shutil.move(str(log_path), run_dir / f"piece{piece}.log"))
    step_to, total_now = checkpoint_step(run_dir) if run_dir.is_dir() else (0, None)
    if code == 0:
        outcome = "finished"
    elif signalled and not killed and PREEMPTED_LINE in text:  # torchrun itself exits 1 after its workers' 75
        outcome = "stopped"
    elif killed:
        outcome = "killed"  # it did not stop in --margin seconds: the last periodic checkpoint is kept
    else:
        outcome = "failed"
    record |= dict(end=utc(end_wall), end_time=end_wall, step_to=step_to)
    record |= dict(total_timesteps=total_now or total or flags_total(run_dir))
    record |= dict(exit_code=code, outcome=outcome)
    if run_dir.is_dir():
        with open(records, "a") as f:
            f.write(json.dumps(record) + "\n")
        running.unlink(missing_ok=True)
    minutes = (end_wall - start_wall) / 60
    steps = f"steps {step_from} -> {step_to} of {record['total_timesteps']}"
    print(f"run_in_calls: piece {piece} {outcome} (exit {code}) after {minutes:.1f} min: {steps}")
    if outcome in ("failed", "killed"):
        print("\n".join(text.splitlines()[-15:]), file=sys.stderr)
    if args.out and run_dir.is_dir():
        parts = pack(run_dir, Path(args.out), part_bytes)
        (Path(args.out) / f"{name}.piece.json").write_text(json.dumps(record, indent=1) + "\n")
        size = sum(p.stat().st_size for p in parts)
        names = ", ".join(p.name for p in parts)
        print(f"run_in_calls: packed {run_dir} into {args.out}: {names} ({size / 2**20:.1f} MiB)")
    return 0 if outcome in ("finished", "stopped") else 1


if __name__ == "__main__":
    sys.exit(main())
