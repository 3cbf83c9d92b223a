"""Run one long training run as a sequence of pieces, each a few minutes: start or resume it, stop it cleanly
before a deadline, and leave its run directory where the next piece finds it.

A GPU of this workplace is lent in device calls of at most 10 minutes, each on a fresh copy of the repository
(64 MiB carried in, at most 8 files of 16 MiB each back from $OUT). A 10M-step Atari run is then several calls,
each resuming the run that the last one brought back (benchmark/repro/atari_in_calls.md has the whole sequence):

    # piece 1: start; SIGTERM at 8.5 minutes minus --margin: the run checkpoints at the end of its iteration and
    # exits 75; its run directory is packed into $OUT as {run name}.tgz.part0, .part1, ... (15 MiB each)
    python -m benchmark.run_in_calls --minutes 8.5 --out $OUT --script cleanrl_ddp/ppo_atari_multigpu.py \
        --env-id BreakoutNoFrameskip-v4 --seed 1 -- --cudagraphs
    # here, between calls: copy what came back into runs/carry/ (git-ignored), then pieces 2, 3, ... carry it in
    python -m benchmark.run_in_calls --minutes 8.5 --out $OUT --carried runs/carry --script ... (the same flags)

On a machine of one's own the same command without --out and --carried runs a piece in place: the run directory
under --runs-dir is what the next piece resumes. Without --minutes a piece runs until the run finishes or this
process gets SIGTERM or SIGINT, which it passes on to the run as at a deadline (a clean pause of a long CPU run).

Each piece appends one line to {run dir}/pieces.jsonl: start and end (UTC), global steps from and to, the
machine (and GPU), package versions, exit code, outcome and the exact command; its output is kept as
{run dir}/piece{N}.log. `python -m benchmark.harness report` draws each piece on the run's curve, finished or not.
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
from benchmark.versions import package_versions

PART_BYTES = 15 * 2**20  # a file that comes back from a device call holds at most 16 MiB
MAX_BACK_BYTES = 60 * 2**20  # at most 64 MiB come back in all (and 8 files: 4 parts and the record)
CALL_CARRY_BYTES = 64 * 2**20  # what a device call carries in: the repository's files, the wheels, the archive
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


def pack(run_dir: Path, out: Path) -> list[Path]:
    """The run directory as {name}.tgz.part0, .part1, ... under `out`: what comes back and is carried in next."""
    out.mkdir(parents=True, exist_ok=True)
    archive = out / f"{run_dir.name}.tgz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:  # weights barely compress: be fast
        tar.add(run_dir, arcname=run_dir.name, filter=lambda m: None if m.name.endswith("/lease") else m)
    data, parts = archive.read_bytes(), []
    archive.unlink()
    for i in range(0, max(len(data), 1), PART_BYTES):
        parts.append(out / f"{run_dir.name}.tgz.part{i // PART_BYTES}")
        parts[-1].write_bytes(data[i : i + PART_BYTES])
    return parts


def folder_bytes(folder: Path, leave_out=()) -> int:
    return sum(
        p.stat().st_size
        for p in folder.resolve().rglob("*")
        if p.is_file() and not any(p.is_relative_to(o) for o in leave_out)
    )


def carry_line(archive_bytes: int, wheels: Path, leave_out=()) -> str:
    """What the next call carries in: the archive, the wheels, and the repository's files (git's list where this is
    a checkout; else, as on the device's copy, every file here but the run's own folders)."""
    mib = 2**20
    wheel_bytes = folder_bytes(wheels) if wheels.is_dir() else 0
    try:
        files = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout.split(b"\0")
        tree = sum(os.path.getsize(f) for f in files if f and os.path.isfile(f))
    except (OSError, subprocess.CalledProcessError):
        tree = folder_bytes(Path("."), [wheels.resolve(), *(Path(o).resolve() for o in leave_out)])
    total = archive_bytes + wheel_bytes + tree
    verdict = "fits" if total < CALL_CARRY_BYTES else "DOES NOT FIT"
    return (
        f"carry next call: run archive {archive_bytes / mib:.1f} MiB + {wheels}/ {wheel_bytes / mib:.1f} MiB + "
        f"repository files {tree / mib:.1f} MiB = {total / mib:.1f} MiB of 64 ({verdict})"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", required=True, help="the script, e.g. cleanrl_ddp/ppo_atari_multigpu.py")
    parser.add_argument("--env-id", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=1, help="processes (torchrun above 1)")
    parser.add_argument("--label", default=None, help="the configuration's name in the run name (default ws{N})")
    parser.add_argument("--runs-dir", default="runs/calls", help="where the run directory is (or is unpacked)")
    parser.add_argument("--minutes", type=float, default=None, help="this piece's length; default: no deadline")
    parser.add_argument(
        "--margin",
        type=float,
        default=60.0,
        help=f"seconds before the end of --minutes at which to send SIGTERM; a run still going {PACK_SECONDS} s "
        "before the end is killed (its last periodic checkpoint stays)",
    )
    parser.add_argument("--out", default=None, help="pack the run directory here at the end ($OUT on the device)")
    parser.add_argument("--carried", default=None, help="a folder holding the parts a previous piece packed")
    parser.add_argument("--wheels", default=".whl", help="the wheels a device call carries (for the size it reports)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- then the script's own flags")
    args = parser.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    start_wall, start = time.time(), time.monotonic()
    deadline = None if args.minutes is None else start + 60 * args.minutes
    if args.margin <= PACK_SECONDS:
        parser.error(f"--margin must leave the run time to checkpoint: more than {PACK_SECONDS} s")
    if deadline is not None and 60 * args.minutes <= args.margin:
        parser.error(f"--minutes {args.minutes} leaves no time to run before the --margin of {args.margin:.0f} s")

    runs_dir = Path(args.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
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
    record |= dict(log=f"piece{piece}.log")
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
    record |= dict(total_timesteps=total_now or total or flags_total(run_dir), versions=package_versions())
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
        parts = pack(run_dir, Path(args.out))
        (Path(args.out) / f"{name}.piece.json").write_text(json.dumps(record, indent=1) + "\n")
        size = sum(p.stat().st_size for p in parts)
        names = ", ".join(p.name for p in parts)
        print(f"run_in_calls: packed {run_dir} into {args.out}: {names} ({size / 2**20:.1f} MiB)")
        if size > MAX_BACK_BYTES:
            print(f"run_in_calls: error: {size / 2**20:.1f} MiB will not come back from a device call", file=sys.stderr)
            return 1
        leave_out = [runs_dir, args.out, *([args.carried] if args.carried else [])]
        print(f"run_in_calls: {carry_line(size, Path(args.wheels), leave_out)}")
    return 0 if outcome in ("finished", "stopped") else 1


if __name__ == "__main__":
    sys.exit(main())
