"""Run a script over env ids x seeds x world sizes; collect, tabulate and plot what the runs logged.

    # run (or resume) the grid, one run at a time; finished runs are skipped
    python -m benchmark.harness run --script cleanrl_ddp/ppo_multigpu.py --env-ids CartPole-v1 \
        --seeds 1 2 3 --world-sizes 1 2 --runs-dir runs/bench -- --total-timesteps 200000
    # the same grid as a SLURM array job instead of running it here
    python -m benchmark.harness run ... --slurm runs/bench/array.sbatch -- --total-timesteps 200000
    # tidy CSV of every scalar, learning curves (PNG) and a markdown table, written into docs/
    python -m benchmark.harness report --runs-dir runs/bench --out docs/benchmarks/cartpole

Each run is the script's own command line with `--env-id`, `--seed`, `--runs-dir` and a stable
`--run-name` appended (`torchrun --standalone` when the world size is above 1). A run is complete
when its directory holds `harness.json`, written after the command exits 0; an interrupted run keeps
its name, so running the grid again resumes it from its checkpoint.

The report takes every run directory under --runs-dir that holds TensorBoard events: complete grid runs
(harness.json), runs made in pieces by benchmark/run_in_calls.py (pieces.jsonl: each piece's start, end,
steps, machine and versions, finished or not), and runs launched by hand, ours or a peer's from
benchmark/peers/ (known only by the hyperparameters table the script logged). A run not finished is
reported as such, at its last logged step of its total.
"""

import argparse
import csv
import gzip
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmark.events import read_scalar_events
from benchmark.versions import package_versions, versions_line

RETURN_TAG = "charts/episodic_return"
EPISODES_TAG = "charts/episodes"  # how many episodes each logged return is the mean of
DONE_FILE = "harness.json"
COMMANDS_FILE = "commands.txt"  # beside a report's results.md: every run's command, one per line
PIECES_CSV = "pieces.csv"  # beside a report's results.md: every piece of the runs made in pieces, one per row
PIECES_FILE = "pieces.jsonl"  # one line per piece of a run made in pieces (benchmark/run_in_calls.py)
RUNNING_FILE = "piece_running.json"  # the piece in progress: its start, command and machine
PUBLISHED = Path(__file__).with_name("published_returns.csv")
FINAL_EPISODES = 100  # CleanRL's final return: the mean of each run's last 100 episodes (openrlbenchmark's default)
PEERS = {"cleanrl_ppo_atari_multigpu": "ppo_atari_multigpu", "cleanrl_pqn": "pqn_multigpu"}
"""benchmark/peers/ scripts (by exp_name): their runs are drawn in the figure of the script they are measured against"""


def config_name(world_size: int, label: str | None = None) -> str:
    """A configuration's name in run names, tables and legends: `--label` when given, else `ws{world size}`."""
    return label or f"ws{world_size}"


def run_name(script: str, env_id: str, world_size: int, seed: int, label: str | None = None) -> str:
    return f"{env_id.replace('/', '-')}__{Path(script).stem}__{config_name(world_size, label)}__seed{seed}"


def run_command(script, env_id, seed, world_size, runs_dir, extra, label=None) -> list[str]:
    """The run's command line, with this Python (`portable` rewrites it as a reader types it)."""
    name = run_name(script, env_id, world_size, seed, label)
    tail = ["--env-id", env_id, "--seed", str(seed), "--runs-dir", runs_dir, "--run-name", name]
    return [*launcher(world_size), script, *extra, *tail]


def launcher(world_size: int) -> list[str]:
    """This Python, or torchrun on one node above world size 1."""
    if world_size == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}"]


def rank_threads(world_size: int, cores=None) -> int:
    """Threads per rank of a run at `world_size` on `cores` (default: this process's), as the scripts choose.
    Shared by benchmark/throughput.py (the env-only ceiling) and benchmark/profile_rollout.py (the profiled rank)."""
    return max(1, len(cores or os.sched_getaffinity(0)) // world_size)


def grid(args) -> list[dict]:
    return [
        dict(
            script=args.script,
            env_id=env_id,
            seed=seed,
            world_size=ws,
            label=args.label,
            config=config_name(ws, args.label),
            name=run_name(args.script, env_id, ws, seed, args.label),
        )
        for env_id in args.env_ids
        for ws in args.world_sizes
        for seed in args.seeds
    ]


def execute(run: dict, runs_dir: str, extra: list[str], timeout: float | None) -> dict:
    """Run one command, its output to `<runs_dir>/<name>.log`; on success write harness.json."""
    cmd = run_command(run["script"], run["env_id"], run["seed"], run["world_size"], runs_dir, extra, label=run["label"])
    log_path = Path(runs_dir) / f"{run['name']}.log"
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.time() - start
    if proc.returncode == 0:
        record = dict(
            run,
            command=shlex.join(cmd),
            wall_time_s=wall,
            finished=time.strftime("%Y-%m-%d %H:%M:%S"),
            machine=f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
            versions=package_versions(),  # of this environment, which ran the command
        )
        (Path(runs_dir) / run["name"] / DONE_FILE).write_text(json.dumps(record, indent=1))
    return dict(run, returncode=proc.returncode, wall_time_s=wall, log=str(log_path))


def slurm_array(runs: list[dict], runs_dir: str, extra: list[str]) -> str:
    """An sbatch script whose array task i runs the i-th pending run (one node each), through this harness: the
    task writes the run's log and, when the run succeeds, its harness.json, as a run here does. sbatch it from
    the repository root (the task runs `python -m benchmark.harness`)."""
    max_ws = max(r["world_size"] for r in runs)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --array=0-{len(runs) - 1}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        f"#SBATCH --cpus-per-task={max(2, 2 * max_ws)}",
        f"#SBATCH --gpus-per-task={max_ws}",
        f"#SBATCH --output={runs_dir}/slurm-%A_%a.log",
        "# generated by benchmark/harness.py; each task runs one run of the grid through the harness",
        "cmds=(",
    ]
    for run in runs:
        cmd = ["python", "-m", "benchmark.harness", "run", "--script", run["script"], "--env-ids", run["env_id"]]
        cmd += ["--seeds", str(run["seed"]), "--world-sizes", str(run["world_size"]), "--runs-dir", runs_dir]
        cmd += ["--label", run["label"]] if run["label"] else []
        lines.append("  " + shlex.quote(shlex.join([*cmd, "--", *extra])))
    lines += [")", 'eval "${cmds[$SLURM_ARRAY_TASK_ID]}"', ""]
    return "\n".join(lines)


def cmd_run(args) -> int:
    os.makedirs(args.runs_dir, exist_ok=True)
    runs = grid(args)
    pending = [r for r in runs if not (Path(args.runs_dir) / r["name"] / DONE_FILE).is_file()]
    print(f"{len(runs)} runs in the grid, {len(runs) - len(pending)} complete, {len(pending)} to run")
    if not pending:
        return 0
    if args.slurm:
        Path(args.slurm).write_text(slurm_array(pending, args.runs_dir, args.extra))
        print(f"wrote {args.slurm}: sbatch it to run {len(pending)} array tasks")
        return 0
    failed = 0
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for result in pool.map(lambda r: execute(r, args.runs_dir, args.extra, args.timeout), pending):
            status = "ok" if result["returncode"] == 0 else f"FAILED (exit {result['returncode']}, see {result['log']})"
            print(f"  {result['name']}: {status} in {result['wall_time_s']:.0f} s", flush=True)
            failed += result["returncode"] != 0
    return 1 if failed else 0


def hyperparameters(run_dir) -> dict[str, str]:
    """The `hyperparameters` table a script logged to TensorBoard ({name: value as text}); ours and CleanRL's
    scripts log one, with the flags and the sizes derived from the world size."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "scalars": 1})
    acc.Reload()
    if "hyperparameters/text_summary" not in acc.Tags()["tensors"]:
        return {}
    text = acc.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
    cells = [line.strip("|").split("|", 1) for line in text.splitlines()[2:]]
    return {cell[0]: cell[1] for cell in cells if len(cell) == 2}


def run_meta(run_dir: Path, events: dict) -> dict | None:
    """What the report knows of one run directory, in the same keys whatever made it: its harness.json (a complete
    grid run), else its pieces.jsonl (a run made in pieces, finished or not), else the hyperparameters table its
    script logged (a run launched by hand, or a grid run not complete). None: not a run of a known script."""
    last_step = max((s for evs in events.values() for _, s, _ in evs), default=0)
    walls = [w for evs in events.values() for w, _, _ in evs]
    pieces_file, running = run_dir / PIECES_FILE, run_dir / RUNNING_FILE
    pieces = [json.loads(line) for line in pieces_file.read_text().splitlines()] if pieces_file.is_file() else []
    if running.is_file() and walls:  # in progress: as far as its events go
        now = max(walls)
        pieces.append(json.loads(running.read_text()) | dict(end=utc(now), end_time=now, step_to=last_step))
        pieces[-1] = dict(versions={}) | pieces[-1] | dict(exit_code="-")  # versions: its own, where it recorded them
    if (run_dir / DONE_FILE).is_file():
        done = json.loads((run_dir / DONE_FILE).read_text())
        meta = {k: done[k] for k in ("name", "script", "env_id", "seed", "world_size")}
        meta |= dict(config=done.get("config") or config_name(done["world_size"]), finished=True, total=last_step)
        meta |= dict(commands=[portable(done["command"])], machines=[done["machine"]], ended=done["finished"])
        meta |= dict(versions=[done["versions"]] if "versions" in done else [], wall_time_s=done["wall_time_s"])
    elif pieces:
        last = pieces[-1]
        meta = {k: last[k] for k in ("name", "script", "env_id", "seed", "world_size", "config")}
        meta |= dict(finished=last["outcome"] == "finished", total=last["total_timesteps"], ended=last["end"])
        meta |= dict(commands=list(dict.fromkeys(p["portable_command"] for p in pieces)))
        meta |= dict(machines=list(dict.fromkeys(p["machine"] for p in pieces)))
        meta |= dict(versions=[p["versions"] for p in pieces if p["versions"]])
        meta |= dict(wall_time_s=sum(p["end_time"] - p["start_time"] for p in pieces))
    else:
        table = hyperparameters(run_dir)
        if "env_id" not in table or "world_size" not in table:
            return None
        flags = run_dir / "flags.json"
        exp = json.loads(flags.read_text())["script"] if flags.is_file() else table.get("exp_name", run_dir.name)
        ws, parts = int(table["world_size"]), run_dir.name.split("__")
        config = config_name(ws) if exp not in PEERS else f"{exp}-ws{ws}"
        if len(parts) == 4 and parts[1] == exp and parts[3].startswith("seed"):  # a grid run's name
            config = parts[2]
        total, batch = int(table.get("total_timesteps", 0)), int(table.get("batch_size", 0))
        meta = dict(name=run_dir.name, script=PEERS.get(exp, exp), env_id=table["env_id"], seed=int(table["seed"]))
        meta |= dict(world_size=ws, config=config, finished=last_step + batch > total, total=total)
        meta |= dict(commands=[], machines=[], versions=[], wall_time_s=(max(walls) - min(walls)) if walls else 0.0)
        meta |= dict(ended=utc(max(walls)) if walls else "-")
    return meta | dict(step=last_step, pieces=pieces, run_dir=str(run_dir))


def utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def active_seconds(wall: float, pieces: list[dict]) -> float:
    """Seconds a run made in pieces had run by `wall`: the time between pieces left out."""
    return sum(min(max(wall - p["start_time"], 0.0), p["end_time"] - p["start_time"]) for p in pieces)


def runs_with_events(runs_dir) -> list[tuple[dict, dict]]:
    """(meta, events) of every run directory under runs_dir that holds TensorBoard events of a known script."""
    found = []
    for run_dir in sorted(p for p in Path(runs_dir).iterdir() if p.is_dir()):
        if not any(run_dir.glob("events.out.tfevents.*")):
            continue
        events = read_scalar_events(run_dir)
        meta = run_meta(run_dir, events)
        if meta is not None:
            found.append((meta, events))
    return found


def collect(runs_dir) -> tuple[list[dict], list[dict]]:
    """One row per logged scalar of every run (the tidy table), and each run's meta (`run_meta`)."""
    rows, metas = [], []
    for meta, events in runs_with_events(runs_dir):
        metas.append(meta)
        t0 = min((w for evs in events.values() for w, _, _ in evs), default=0.0)
        for tag, evs in events.items():
            for wall, step, value in evs:
                seconds = active_seconds(wall, meta["pieces"]) if meta["pieces"] else wall - t0
                rows.append(
                    dict(
                        script=Path(meta["script"]).stem,
                        env_id=meta["env_id"],
                        world_size=meta["world_size"],
                        config=meta["config"],
                        seed=meta["seed"],
                        run=meta["name"],
                        tag=tag,
                        step=step,
                        time_s=round(seconds, 3),
                        value=value,
                    )
                )
    return rows, metas


def status(metas) -> str:
    """`finished`, or `not finished: at step X of Y` (the least advanced seed's)."""
    unfinished = [m for m in metas if not m["finished"]]
    if not unfinished:
        return "finished"
    slowest = min(unfinished, key=lambda m: m["step"])
    return f"not finished: at step {slowest['step']:,} of {slowest['total']:,}"


def key_of(meta) -> tuple:
    return (Path(meta["script"]).stem, meta["env_id"], int(meta["world_size"]), meta["config"])


def series(rows, tag):
    """{(script, env_id, world_size, config): {seed: (steps, times, values)}} for one tag."""
    out = defaultdict(dict)
    for (key, seed), items in _group(rows, tag).items():
        items.sort(key=lambda r: r["step"])
        out[key][seed] = tuple(np.array([r[f] for r in items], dtype=float) for f in ("step", "time_s", "value"))
    return out


def _group(rows, tag):
    groups = defaultdict(list)
    for r in rows:
        if r["tag"] == tag:
            groups[((r["script"], r["env_id"], int(r["world_size"]), r["config"]), r["seed"])].append(r)
    return groups


def mean_curve(per_seed: dict, x_index: int, points: int = 200):
    """Mean and std over seeds of the return, interpolated on a common x grid (steps or seconds)."""
    x_max = min(s[x_index][-1] for s in per_seed.values())
    grid_x = np.linspace(0, x_max, points)
    ys = np.stack([np.interp(grid_x, s[x_index], s[2]) for s in per_seed.values()])
    return grid_x, ys.mean(0), ys.std(0)


def final_return(returns: np.ndarray, counts: np.ndarray, episodes: int = FINAL_EPISODES) -> float:
    """The mean return of a run's last `episodes` episodes, CleanRL's final return.

    Each logged return is the mean of `counts` episodes (one iteration's, over all ranks), so the last
    logged points are weighted by their counts, and the oldest of them only by the episodes still needed.
    """
    weights = np.zeros(len(returns))
    needed = float(episodes)
    for i in range(len(returns) - 1, -1, -1):
        weights[i] = min(counts[i], needed)
        needed -= weights[i]
        if needed <= 0:
            break
    return float(np.dot(weights, returns) / weights.sum())


def episode_counts(rows, returns: dict) -> dict:
    """Per key and seed, the episode count of each logged return (1 each where a run did not log counts)."""
    counts = series(rows, EPISODES_TAG)
    out = defaultdict(dict)
    for key, per_seed in returns.items():
        for seed, (steps, _, _) in per_seed.items():
            by_step = dict(zip(*counts.get(key, {}).get(seed, ((), (), ()))[::2], strict=True))
            out[key][seed] = np.array([by_step.get(step, 1.0) for step in steps])
    return out


def read_published(path=PUBLISHED) -> dict:
    """{(script, env_id): row} of published final returns (mean, std over seeds) to compare against."""
    if not Path(path).is_file():
        return {}
    with open(path, newline="") as f:
        return {(r["script"], r["env_id"]): r for r in csv.DictReader(line for line in f if not line.startswith("#"))}


def plot_curves(rows, metas, out: Path, published: dict) -> list[Path]:
    """One figure per (script, env): each configuration's mean ± std over seeds, against global steps and wall time
    (the time between pieces left out), with the published final return (mean ± std) where there is one. A run made
    in pieces shows where each piece ended (dotted); a configuration not finished says so in its legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = series(rows, RETURN_TAG)
    paths = []
    by_plot = defaultdict(dict)
    for (script, env_id, ws, config), per_seed in curves.items():
        by_plot[(script, env_id)][(ws, config)] = per_seed
    for (script, env_id), per_config in sorted(by_plot.items()):
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        for (ws, config), per_seed in sorted(per_config.items()):
            runs = [m for m in metas if key_of(m) == (script, env_id, ws, config)]
            state = status(runs)
            label = f"{config} (world size {ws}, {len(per_seed)} seeds)" + ("" if state == "finished" else f", {state}")
            for ax, x_index, xlabel in ((axes[0], 0, "global env steps"), (axes[1], 1, "wall time (s)")):
                x, mean, std = mean_curve(per_seed, x_index)
                line = ax.plot(x, mean, label=label)[0]
                ax.fill_between(x, mean - std, mean + std, alpha=0.2)
                ax.set_xlabel(xlabel)
            for m in runs:  # where each piece but the last ended: the run was stopped there and resumed
                for p in m["pieces"][:-1]:
                    axes[0].axvline(p["step_to"], color=line.get_color(), linestyle=":", linewidth=0.8)
        if (script, env_id) in published:
            ref = published[(script, env_id)]
            mean, std = float(ref["mean"]), float(ref["std"])
            at = f" at {int(ref['steps']):,} steps" if ref.get("steps") else ""
            axes[0].axhline(mean, color="black", linestyle="--", linewidth=1, label=f"{ref['label']}: final return{at}")
            axes[0].axhspan(mean - std, mean + std, color="black", alpha=0.15)
        axes[0].set_ylabel("episodic return")
        axes[0].legend(loc="best", fontsize=7)
        fig.suptitle(f"{script} on {env_id} (mean ± std over seeds)")
        fig.tight_layout()
        path = out / f"{script}__{env_id.replace('/', '-')}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def portable(command: str) -> str:
    """A logged command as a reader types it: `torchrun`/`python` instead of this machine's interpreter path."""
    words = shlex.split(command)
    words = ["torchrun", *words[3:]] if words[1:3] == ["-m", "torch.distributed.run"] else ["python", *words[1:]]
    return shlex.join(words)


def markdown_table(rows, metas, published: dict) -> str:
    returns, sps = series(rows, RETURN_TAG), series(rows, "charts/SPS")
    counts = episode_counts(rows, returns)
    lines = [
        "| script | env | configuration | world size | seeds | steps | final return | published | "
        "SPS (median) | wall time (min) | status |"
    ]
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(returns):
        script, env_id, ws, config = key
        runs = [m for m in metas if key_of(m) == key]
        finals = [final_return(v, counts[key][seed]) for seed, (_, _, v) in returns[key].items()]
        sps_med = [float(np.median(v[len(v) // 10 :])) for _, _, v in sps.get(key, {}).values()]
        walls = [m["wall_time_s"] / 60 for m in runs]
        steps = min(m["step"] for m in runs)  # the last logged step, of any scalar
        ref = published.get((script, env_id))
        versus = "–"
        if ref:
            mean, std = float(ref["mean"]), float(ref["std"])
            inside = "inside" if abs(np.mean(finals) - mean) <= 2 * std else "outside"
            at = f" at {int(ref['steps']):,} steps" if ref.get("steps") else ""
            compared = f"ours {inside} ± 2 std" if all(m["finished"] for m in runs) else "not finished"
            versus = f"{mean:.1f} ± {std:.1f} ({ref['label']}{at}; {compared})"
        lines.append(
            f"| {script} | {env_id} | {config} | {ws} | {len(finals)} | {steps} | "
            f"{np.mean(finals):.1f} ± {np.std(finals):.1f} | {versus} | {np.mean(sps_med):.0f} | {np.mean(walls):.1f} "
            f"| {status(runs)} |"
        )
    commands = run_commands(metas)
    by_hand = sorted(m["name"] for m in metas if not m["commands"])
    machines = sorted({machine for m in metas for machine in m["machines"]})
    lines += [
        "",
        f"Final return: each run's mean return over its last {FINAL_EPISODES} episodes (CleanRL's, as openrlbenchmark "
        "computes it; a logged return is the mean of one iteration's episodes, weighted by their count), then mean "
        "± std (numpy's, ddof 0) over seeds. A run not finished: the same, over its last episodes so far.",
    ]
    shown = {key[:2] for key in returns}
    sources = sorted({f"{r['label']}: {r['source']}" for key, r in published.items() if key in shown})
    lines += ["", *(f"Published: {source}." for source in sources)] if sources else []
    lines += ["", f"Machine: {', '.join(machines) or 'not recorded'}. Last logged: {max(m['ended'] for m in metas)}."]
    lines += ["", packages_line(metas), ""]
    lines += [f"Commands, one per run ({len(commands)}): [{COMMANDS_FILE}]({COMMANDS_FILE}).", ""] if commands else []
    if by_hand:
        lines += [f"Launched by hand (no command, machine or versions recorded): {', '.join(by_hand)}.", ""]
    in_pieces = [m for m in metas if m["pieces"]]
    if in_pieces:
        count = sum(len(m["pieces"]) for m in in_pieces)
        lines += [
            f"Runs made in pieces ({len(in_pieces)}): each piece's start, steps, commit, machine, versions "
            f"and outcome, one per row ({count}): [{PIECES_CSV}]({PIECES_CSV}).",
            "",
        ]
    return "\n".join(lines)


def run_commands(metas) -> list[str]:
    """Every run's command line as a reader types it, each once (written to COMMANDS_FILE beside the report)."""
    return sorted({c for m in metas for c in m["commands"]})


def piece_rows(metas) -> list[dict]:
    """Every piece of the runs made in pieces (written to PIECES_CSV beside the report): when and where each ran,
    its steps and how it ended; a piece still under way runs to its run's last logged step."""
    rows = []
    for m in sorted((m for m in metas if m["pieces"]), key=lambda m: m["name"]):
        for p in m["pieces"]:
            running = p["outcome"] == "running"
            rows.append(
                {
                    "run": m["name"],
                    "piece": p["piece"],
                    "start (UTC)": p["start"],
                    "minutes": f"{(p['end_time'] - p['start_time']) / 60:.1f}",
                    "step from": p["step_from"],
                    "step to": p["step_to"],
                    "commit": p.get("commit", ""),
                    "machine": p["machine"],
                    "versions": versions_line(p["versions"]) if p["versions"] else "",
                    "outcome": "running, to its last logged step" if running else p["outcome"],
                    "exit code": "" if running else p["exit_code"],
                }
            )
    return rows


def packages_line(metas) -> str:
    """The package versions the runs ran with (harness.json's `versions`, each piece's), each distinct set once with
    its run count."""
    sets = defaultdict(int)
    for m in metas:
        found = {versions_line(v) for v in m["versions"]}
        for line in found or {"not recorded (runs before the harness kept them, or launched by hand)"}:
            sets[line] += 1
    if len(sets) == 1:
        return f"Packages: {next(iter(sets))}."
    return "Packages: " + "; ".join(f"{line} ({n} runs)" for line, n in sorted(sets.items())) + "."


def cmd_report(args) -> int:
    rows, metas = collect(args.runs_dir)
    if not rows:
        print(f"no runs (run directories with TensorBoard events) under {args.runs_dir}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kept = [r for r in rows if not args.tags or r["tag"].startswith(tuple(args.tags))]
    with gzip.open(out / "scalars.csv.gz", "wt", newline="") as f:  # compressed: small enough to commit
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(kept)
    published = read_published(args.published)
    plots = plot_curves(rows, metas, out, published)
    table = markdown_table(rows, metas, published)
    (out / "results.md").write_text(table + "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n")
    commands = run_commands(metas)
    if commands:
        (out / COMMANDS_FILE).write_text("\n".join(commands) + "\n")
    pieces = piece_rows(metas)
    if pieces:
        with open(out / PIECES_CSV, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(pieces[0]))
            writer.writeheader()
            writer.writerows(pieces)
    print(f"wrote {out / 'scalars.csv.gz'} ({len(kept)} rows), {len(plots)} plot(s), {out / 'results.md'}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or resume) the grid; arguments after -- go to the script")
    run.add_argument("--script", required=True, help="path of the script, e.g. cleanrl_ddp/ppo_multigpu.py")
    run.add_argument("--env-ids", nargs="+", required=True, help="env ids, each passed as --env-id")
    run.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds, each passed as --seed")
    run.add_argument("--world-sizes", nargs="+", type=int, default=[1], help="processes per run (torchrun above 1)")
    run.add_argument(
        "--label",
        default=None,
        help="the configuration's name in run names and the report (default ws{N}); give one per configuration "
        "when two configurations share a world size, e.g. --label ws2-same-batch -- --num-steps 1024",
    )
    run.add_argument("--runs-dir", default="runs/benchmark", help="where run directories and logs go")
    run.add_argument("--jobs", type=int, default=1, help="how many runs at a time")
    run.add_argument("--timeout", type=float, default=None, help="seconds after which a run is killed")
    run.add_argument("--slurm", default=None, help="write an sbatch array script here instead of running")
    run.add_argument("extra", nargs=argparse.REMAINDER, help="-- then arguments for every run of the script")
    report = sub.add_parser("report", help="tidy CSV, learning curves and a markdown table of the runs")
    report.add_argument("--runs-dir", default="runs/benchmark", help="the directory the runs were written to")
    report.add_argument("--out", required=True, help="output directory, e.g. docs/benchmarks/cartpole")
    report.add_argument(
        "--tags",
        nargs="+",
        default=None,
        help="keep only these tags (or tag prefixes, e.g. charts/) in the CSV; the table and plots use all",
    )
    report.add_argument(
        "--published",
        default=str(PUBLISHED),
        help="CSV of published final returns (script, env_id, label, mean, std, source) set beside ours",
    )
    args = parser.parse_args(argv)
    if args.command == "run":
        if args.label and len(args.world_sizes) > 1:
            run.error("--label names one configuration: give it one world size")
        if not Path(args.script).is_file():
            run.error(f"--script {args.script}: no such file")
        if min(args.world_sizes) < 1 or args.jobs < 1:
            run.error(f"--world-sizes and --jobs must be at least 1, got {args.world_sizes} and {args.jobs}")
        args.extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
        return cmd_run(args)
    if not Path(args.runs_dir).is_dir():
        report.error(f"--runs-dir {args.runs_dir}: no such directory")
    return cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
