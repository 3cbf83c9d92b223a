"""Steady-state throughput (global agent steps/s) of a script at several world sizes, with the env-only ceiling.

    # Breakout, 4 envs per rank, 128 steps: world sizes 1-3 with one core per rank, ddp vs flat
    python -m benchmark.throughput --script cleanrl_ddp/ppo_atari_multigpu.py --world-sizes 1 2 3 \
        --cores-per-rank 1 --variant ddp= --variant flat="--grad-sync flat" --repeats 2 --out docs/benchmarks/x

Each run is the script's own command line (`torchrun --standalone` above world size 1) with a budget
of `--iterations` iterations. Throughput is read from what the run logged: the wall times and global
steps of its `charts/SPS` events after the first `--warmup` ones (start-up, first-touch allocations
and the first checkpoint are excluded), so it is the rate of the steady state. The table gives the
median over `--repeats` (seeds 1, 2, ...).

Scaling is weak scaling: every rank keeps `--local-num-envs` envs, so the global batch grows with the
world size, and with `--cores-per-rank N` each run is pinned to world size x N cores (the scripts give
each rank cores // ranks threads), so efficiency = SPS(n) / (n x SPS(1)) compares like with like until
the machine runs out of cores (marked "oversubscribed"). The time shares come from the `perf/*`
scalars rank 0 logs: the update's share of each iteration, and the share of the update spent in the
gradient all-reduce, which only `--grad-sync flat` times apart (DDP overlaps it with the backward pass).

The env-only ceiling steps the same vector env (built by the script's own `make_env`) with random
actions, one process per rank with the same env count, threads and cores: no network, no learning.
It is measured in the same invocation, so a loaded machine depresses both alike, and each row gives
its share of it.

`--env-sweep 8 64` measures only the env layer: the env-only rate of ALE's `AtariVectorEnv`, built by the
script's `make_env`, for each `num_threads` (1, 2, 4, ... up to the scripts' own min(envs, cores)) and `batch_size`
(every env, as the synchronous scripts step them; half, through `send`/`recv` as EnvPool's asynchronous mode), one
setting after another in one process, and prints the best setting per env count next to the scripts' own:

    python -m benchmark.throughput --env-sweep 8 64 --env-sweep-steps 4000

`--profile` adds, for each world size and each Atari PPO script measured, the time split of one rank's
iteration (env step, policy step, host<->device copies, bookkeeping, update; benchmark/profile_rollout.py)
next to that run's SPS and ceiling:

    python -m benchmark.throughput --world-sizes 1 --local-num-envs 8 --profile \
        --compare cleanrl_ddp/ppo_atari_async_multigpu.py

CleanRL's own script beside ours, at 2 ranks x 4 envs (one outside cleanrl_ddp/ takes only CleanRL's flags, not
those after `--`: its own go in `--peer-flags`):

    python -m benchmark.throughput --world-sizes 2 --local-num-envs 4 \
        --compare benchmark/peers/cleanrl_ppo_atari_multigpu.py

With `-- --cudagraphs` (or `-- --no-cudagraphs`) the runs take the flag and the profile follows it; without either,
both take the script's default.
"""

import argparse
import functools
import importlib
import json
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmark.events import read_scalar_events
from benchmark.harness import launcher, portable, rank_threads, run_command
from benchmark.versions import package_versions, versions_line

SPS_TAG = "charts/SPS"
REPO = Path(__file__).resolve().parents[1]
CEILING = "env-only ceiling (random actions)"


def steady_sps(events: list[tuple[float, int, float]], warmup: int) -> float:
    """Global steps per second between the `warmup`-th and the last `charts/SPS` event."""
    if len(events) <= warmup:
        raise ValueError(f"only {len(events)} iterations logged; need more than --warmup {warmup}")
    (t0, s0, _), (t1, s1, _) = events[max(warmup, 1) - 1], events[-1]
    return (s1 - s0) / (t1 - t0)


def rank_cores(world_size: int, cores_per_rank: int) -> list[int] | None:
    """The cores a run at `world_size` is pinned to: `cores_per_rank` each while the machine has them
    (weak scaling adds cores with ranks), else all of them (oversubscribed). None: no pinning."""
    if cores_per_rank <= 0:
        return None
    available = sorted(os.sched_getaffinity(0))
    return available[: world_size * cores_per_rank] if world_size * cores_per_rank <= len(available) else available


def run_once(script, env_id, world_size, seed, variant_flags, sizes, iterations, timeout, cores=None, peer_flags=()):
    """One run of the script's own command line; returns the command, every scalar rank 0 logged, and the flags the
    run took (its flags.json: the script's defaults included, so that a row can say which path ran).

    A script outside cleanrl_ddp/ (CleanRL's own, benchmark/peers/) gets CleanRL's flags only: the sizes, --env-id,
    --seed and, last (so they win), `peer_flags` (--peer-flags), and runs in a folder of its own, where it writes
    runs/<name>. One with no --local-num-envs is a single-process script (CleanRL's ppo.py): at world size 1 its
    --num-envs is our --local-num-envs."""
    steps_per_iteration = world_size * sizes["local_num_envs"] * max(1, sizes["num_steps"])
    size_flags = ["--local-num-envs", str(sizes["local_num_envs"])]
    if sizes["num_steps"]:  # rollout length (PPO); 0 = the script has none (DQN: one step per iteration)
        size_flags += ["--num-steps", str(sizes["num_steps"])]
    size_flags += ["--total-timesteps", str(iterations * steps_per_iteration)]
    with tempfile.TemporaryDirectory(prefix="throughput_") as runs_dir:
        if is_ours(script):
            extra = [*variant_flags, *size_flags, *sizes["extra"], "--checkpoint-every", "0"]
            cmd, cwd, runs = run_command(script, env_id, seed, world_size, runs_dir, extra), None, Path(runs_dir)
        else:
            if single_process(script):
                size_flags[0] = "--num-envs"
            peer = [*launcher(world_size), os.path.abspath(script), *variant_flags, *size_flags]
            peer += ["--env-id", env_id, "--seed", str(seed), *peer_flags]  # last, so that they win (an EnvPool id)
            cmd, cwd, runs = peer, runs_dir, Path(runs_dir) / "runs"
        env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None  # torchrun's workers inherit it
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=pin, cwd=cwd)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
        events = read_scalar_events(run_dir)
        flags = run_dir / "flags.json"  # our scripts write it; another project's may not
        args = json.loads(flags.read_text())["args"] if flags.is_file() else {}
    # as a reader types it: python / torchrun, the script as given
    command = portable(shlex.join(cmd)).replace(shlex.quote(os.path.abspath(script)), shlex.quote(script))
    if cores:
        command = f"taskset -c {','.join(map(str, cores))} {command}"
    return dict(command=command, events=events, args=args)


def is_ours(script: str) -> bool:
    """A script of a cleanrl_ddp/ folder, this checkout's or another's (our flags), not another project's
    (benchmark/peers/: CleanRL's flags only)."""
    return Path(script).resolve().parent.name == "cleanrl_ddp"


def single_process(script: str) -> bool:
    """Another project's script without --local-num-envs (CleanRL's ppo.py): one process, --num-envs envs."""
    return not is_ours(script) and "local_num_envs" not in Path(script).read_text()


def time_shares(events: dict, warmup: int) -> tuple[float, float]:
    """From rank 0's `perf/*` scalars after warm-up: the update's share of the time, and the flat gradient
    all-reduce's share of update time (nan where not logged: under DDP the all-reduce overlaps the
    backward pass and is not timed apart). The time is rollout + update where the script logs its
    rollout (PPO), else the wall time between the logged points (DQN, which interleaves them)."""

    def total(tag):
        return sum(v for _, _, v in events.get(tag, [])[warmup:])

    update, sync = total("perf/update_seconds"), total("perf/grad_sync_seconds")
    if "perf/rollout_seconds" in events:
        elapsed = update + total("perf/rollout_seconds")
    else:
        points = events.get("perf/update_seconds", [])
        elapsed = points[-1][0] - points[warmup - 1][0] if 0 < warmup < len(points) else 0.0
    update_share = update / elapsed if "perf/update_seconds" in events and elapsed else np.nan
    sync_share = sync / update if "perf/grad_sync_seconds" in events and update else np.nan
    return update_share, sync_share


# Env-only ceiling: one process per rank stepping the script's own vector env with random actions
def make_vector_env(module, env_id: str, num_envs: int, num_threads: int):
    """The script's envs: an Atari script's `make_env` returns ALE's vector env, the others' a thunk per env."""
    from cleanrl_ddp import atari

    if atari.is_atari_script(module.__name__):
        return module.make_env(env_id, num_envs, num_threads)
    import gymnasium as gym

    return gym.vector.SyncVectorEnv([module.make_env(env_id) for _ in range(num_envs)])


def ceiling_worker(module_name, env_id, num_envs, num_threads, steps, rank, cores, barrier, results):
    if cores:
        os.sched_setaffinity(0, cores)
    module = importlib.import_module(module_name)
    envs = make_vector_env(module, env_id, num_envs, num_threads)
    envs.reset(seed=rank * num_envs)
    envs.action_space.seed(rank)
    for _ in range(20):  # warm up
        envs.step(envs.action_space.sample())
    barrier.wait()
    start = time.perf_counter()
    for _ in range(steps):
        envs.step(envs.action_space.sample())
    results.put((steps * num_envs, time.perf_counter() - start))
    envs.close()


def env_ceiling(script, env_id, world_size, num_envs, steps, cores=None) -> float:
    """Global random-action steps/s of `world_size` processes, each with the env setup of one rank."""
    module_name = f"cleanrl_ddp.{Path(script).stem}"
    num_threads = rank_threads(world_size, cores)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world_size), ctx.Queue()
    procs = [
        ctx.Process(
            target=ceiling_worker,
            args=(module_name, env_id, num_envs, num_threads, steps, r, cores, barrier, results),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    done = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return sum(s for s, _ in done) / max(t for _, t in done)


# The env layer's settings: ALE's AtariVectorEnv threads and batch size, env only (what the scripts should ask for)
def env_settings(num_envs: int, cores: int) -> list[tuple[int, int]]:
    """The (num_threads, batch_size) pairs `--env-sweep` measures at `num_envs` envs: 1, 2, 4, ... threads, up to the
    scripts' own min(envs, cores); every env at once (`step`, as the synchronous scripts run), then half of them."""
    most = min(num_envs, cores)  # the scripts' own threads at world size 1
    threads = sorted({2**k for k in range(8) if 2**k < most} | {most})
    batches = [num_envs, num_envs // 2] if num_envs > 1 else [num_envs]
    return [(t, b) for b in batches for t in threads]


def env_rate(script, env_id: str, num_envs: int, num_threads: int, batch_size: int, steps: int) -> float:
    """Random-action agent steps/s of the script's own vector env (its `make_env`) with ALE's `num_threads` and
    `batch_size`: `send` then `recv` of `batch_size` envs (all of them: `step`; fewer: EnvPool's asynchronous mode,
    where `recv` returns the first envs ready), 20 warm-up rounds, then `steps` agent steps timed."""
    module = importlib.import_module(f"cleanrl_ddp.{Path(script).stem}")
    vector_env = module.AtariVectorEnv
    module.AtariVectorEnv = functools.partial(vector_env, batch_size=batch_size)  # make_env's settings + the batch
    try:
        envs = module.make_env(env_id, num_envs, num_threads)
    finally:
        module.AtariVectorEnv = vector_env
    envs.reset(seed=0)
    rng, actions = np.random.default_rng(0), envs.single_action_space.n
    rounds = max(1, steps // batch_size)
    for i in range(20 + rounds):
        if i == 20:
            start = time.perf_counter()
        envs.send(rng.integers(0, actions, batch_size))
        envs.recv()
    rate = rounds * batch_size / (time.perf_counter() - start)
    envs.close()
    return rate


def env_sweep(script, env_id: str, env_counts, steps: int, cores: int) -> list[dict]:
    """`env_rate` of every setting of `env_settings` at each env count, one after another in this process."""
    rows = []
    for n in env_counts:
        for threads, batch in env_settings(n, cores):
            rate = env_rate(script, env_id, n, threads, batch, steps)
            rows.append(dict(num_envs=n, num_threads=threads, batch_size=batch, sps=rate))
            print(f"env-sweep {n} envs: num_threads {threads}, batch_size {batch}: {rate:,.0f} steps/s", flush=True)
    return rows


def best_settings(rows: list[dict], cores: int) -> list[str]:
    """Per env count, one line: the fastest setting; the fastest with every env in each batch (what a synchronous
    script can use), as a multiple of the scripts' own (min(envs, cores) threads)."""
    lines = []
    for n in dict.fromkeys(r["num_envs"] for r in rows):
        mine = [r for r in rows if r["num_envs"] == n]
        best = max(mine, key=lambda r: r["sps"])
        sync = max((r for r in mine if r["batch_size"] == n), key=lambda r: r["sps"])
        own = next(r for r in mine if r["batch_size"] == n and r["num_threads"] == min(n, cores))
        lines.append(
            f"env-sweep {n} envs best: num_threads {best['num_threads']}, batch_size {best['batch_size']}: "
            f"{best['sps']:,.0f} steps/s; all {n} at once: num_threads {sync['num_threads']}, {sync['sps']:,.0f} "
            f"steps/s = {sync['sps'] / own['sps']:.2f}x the scripts' num_threads {own['num_threads']} "
            f"({own['sps']:,.0f})"
        )
    return lines


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant takes NAME=FLAGS (FLAGS may be empty), got {text!r}")
    return name, shlex.split(flags)


def weak_scaling(rows: list[dict]) -> None:
    """Adds each row's weak-scaling efficiency: SPS(n) / (n x SPS(1)) of the same variant (needs world size 1)."""
    base = {r["name"]: r["sps"] for r in rows if r["world_size"] == 1}
    for r in rows:
        r["efficiency"] = r["sps"] / (r["world_size"] * base[r["name"]]) if r["name"] in base else np.nan


def ceiling_shares(rows: list[dict]) -> None:
    """Adds each row's share of the env-only ceiling measured at its world size (nan where none was measured)."""
    ceiling = {r["world_size"]: r["sps"] for r in rows if r["name"] == CEILING}
    for r in rows:
        r["ceiling_share"] = r["sps"] / ceiling[r["world_size"]] if r["world_size"] in ceiling else np.nan


def markdown(rows: list[dict]) -> str:
    def pct(x):
        return "" if np.isnan(x) else f"{100 * x:.0f}%"

    lines = [
        "| world size | cores | variant | global SPS (steady, median) | weak-scaling efficiency "
        "| update share of time | flat all-reduce share of update | share of env-only ceiling | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cores = f"{r['cores']}" + (" (oversubscribed)" if r["cores"] < r["world_size"] else "")
        lines.append(
            f"| {r['world_size']} | {cores} | {r['name']} | {r['sps']:.0f} | {pct(r['efficiency'])} "
            f"| {pct(r['update_share'])} | {pct(r['sync_share'])} | {pct(r['ceiling_share'])} "
            f"| {', '.join(f'{s:.0f}' for s in r['all'])} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: Path) -> None:
    """Global SPS against world size: one line per variant, the env-only ceiling dashed, ideal scaling dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["name"] for r in rows):
        pts = sorted((r["world_size"], r["sps"]) for r in rows if r["name"] == name)
        ceiling = name == CEILING
        ax.plot([ws for ws, _ in pts], [s for _, s in pts], "--" if ceiling else "-", marker="o", label=name)
        if not ceiling and pts[0][0] == 1 and name == rows[0]["name"]:
            sizes = [ws for ws, _ in pts]
            ax.plot(sizes, [ws * pts[0][1] for ws in sizes], ":", color="gray", label=f"{name}: ideal (linear)")
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("global steps per second")
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["world_size"] for r in rows}))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmark.throughput",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--script", default="cleanrl_ddp/ppo_atari_multigpu.py", help="the script to measure")
    parser.add_argument("--env-id", default="BreakoutNoFrameskip-v4")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2], help="processes (ranks) per run")
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        help='NAME=FLAGS, e.g. bf16="--precision bf16"; repeat for several (default: one, the script defaults)',
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        default=[],
        help="other scripts run the same way, as extra rows; one outside cleanrl_ddp/ (CleanRL's own, "
        "benchmark/peers/cleanrl_ppo_atari_multigpu.py) gets only --env-id, --seed, the size flags and --peer-flags",
    )
    parser.add_argument(
        "--peer-flags",
        type=shlex.split,
        default=[],
        help="flags for the --compare scripts outside cleanrl_ddp/, in their own names, as one string, given last "
        "(so they win): --peer-flags='--env-id Breakout-v5 --learning-starts 400' (those after `--` are ours only)",
    )
    parser.add_argument("--local-num-envs", type=int, default=4)
    parser.add_argument("--num-steps", type=int, default=128, help="rollout length; 0 for scripts without one (DQN)")
    parser.add_argument("--iterations", type=int, default=14, help="iterations per run (the budget)")
    parser.add_argument("--warmup", type=int, default=4, help="first logged iterations left out of the steady rate")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration (seeds 1..N); median")
    parser.add_argument(
        "--cores-per-rank",
        type=int,
        default=0,
        help="pin each run to world size x N cores (weak scaling; all cores once the machine runs out); 0 = no pinning",
    )
    parser.add_argument("--ceiling-steps", type=int, default=1000, help="vector-env steps per process (0 = skip)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also split one rank's iteration into env step, policy step, copies, update (Atari PPO scripts)",
    )
    parser.add_argument("--profile-iterations", type=int, default=3, help="profiled iterations, after one warm-up")
    parser.add_argument(
        "--env-sweep",
        type=int,
        nargs="+",
        metavar="ENVS",
        help="instead of runs: the env-only rate of ALE's vector env at these env counts for each num_threads and "
        "batch_size (benchmark.throughput.env_settings), and the best setting of each",
    )
    parser.add_argument("--env-sweep-steps", type=int, default=4000, help="agent steps timed per --env-sweep setting")
    parser.add_argument("--out", type=Path, help="also write DIR/throughput.md and DIR/sps_vs_world_size.png")
    parser.add_argument("extra", nargs="*", help="more flags for the script, after `--`")
    args = parser.parse_args(argv)
    if not Path(args.script).is_file():
        parser.error(f"--script {args.script}: no such file")
    if not is_ours(args.script):
        parser.error(f"--script {args.script}: not a script of cleanrl_ddp/ (another project's: --compare)")
    if min(args.world_sizes) < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--world-sizes and --repeats must be at least 1, --warmup at least 0")
    for script in args.compare:
        if not Path(script).is_file():
            parser.error(f"--compare {script}: no such file")
        if max(args.world_sizes) > 1 and single_process(script):
            parser.error(f"--compare {script} takes no --local-num-envs (one process): use --world-sizes 1")
    if args.peer_flags and all(is_ours(script) for script in args.compare):
        parser.error("--peer-flags: no --compare script of another project to take them (ours take flags after --)")
    if args.iterations <= args.warmup:
        parser.error(f"--iterations {args.iterations} leaves no steady rate after --warmup {args.warmup}: give more")
    if args.env_sweep:
        cores = len(os.sched_getaffinity(0))
        print(f"# {Path(args.script).name}'s make_env, {args.env_id}, random actions, {cores} cores", flush=True)
        rows = env_sweep(args.script, args.env_id, args.env_sweep, args.env_sweep_steps, cores)
        print("\n".join(best_settings(rows, cores)))
        return 0
    variants = args.variant or [("default", [])]
    sizes = dict(local_num_envs=args.local_num_envs, num_steps=args.num_steps, extra=args.extra)

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    machine = f"{platform.node()}, {len(os.sched_getaffinity(0))} cores ({cpu})"
    header = [
        f"# {args.script} on {args.env_id}, {args.local_num_envs} envs per rank: {machine}",
        f"# packages: {versions_line(package_versions())}",
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.iterations} iterations per run, steady rate "
        f"after {args.warmup} logged; median of {args.repeats}",
    ]
    print("\n".join(header), flush=True)
    rows, commands, profiles = [], {}, []
    for ws in args.world_sizes:
        cores = rank_cores(ws, args.cores_per_rank)
        num_cores = len(cores or os.sched_getaffinity(0))
        runs = [(args.script, name, flags) for name, flags in variants]
        runs += [(script, Path(script).name, []) for script in args.compare]
        for script, name, flags in runs:
            sps, shares = [], []
            for rep in range(args.repeats):
                try:
                    run = (script, args.env_id, ws, rep + 1, flags, sizes, args.iterations, args.timeout, cores)
                    out = run_once(*run, peer_flags=args.peer_flags)
                except RuntimeError as e:  # the run's command, exit code and last output, without our traceback
                    raise SystemExit(f"throughput: error: {e}") from None
                sps.append(steady_sps(out["events"][SPS_TAG], args.warmup))
                shares.append(time_shares(out["events"], args.warmup))
                commands[(ws, name)] = out["command"]
                print(f"  ws={ws} {name} seed={rep + 1}: {sps[-1]:.0f} steps/s", flush=True)
            update_share, sync_share = np.median(np.array(shares), axis=0)
            rows.append(
                dict(world_size=ws, cores=num_cores, name=name, sps=statistics.median(sps), all=sps)
                | dict(update_share=update_share, sync_share=sync_share)
            )
        if args.ceiling_steps:
            ceiling = env_ceiling(args.script, args.env_id, ws, args.local_num_envs, args.ceiling_steps, cores)
            rows.append(
                dict(world_size=ws, cores=num_cores, name=CEILING, sps=ceiling)
                | dict(all=[ceiling], update_share=np.nan, sync_share=np.nan)
            )
            print(f"  ws={ws} env-only ceiling: {ceiling:.0f} steps/s", flush=True)
        if args.profile:
            profiles += profile_configuration(args, variants, ws, cores, rows)
    weak_scaling(rows)
    ceiling_shares(rows)

    table = markdown(rows)
    if profiles:
        from benchmark import profile_rollout  # imports torch: only when profiling

        table += (
            "\n\nOne rank's iteration, profiled alone on its share of the cores (seconds per iteration, share):\n\n"
        )
        table += profile_rollout.markdown(profiles)
    command_lines = [f"# ws={ws} {name}: {cmd}" for (ws, name), cmd in commands.items()]
    print(f"\n{table}\n\n" + "\n".join(command_lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        invocation = shlex.join(["python", "-m", "benchmark.throughput", *(argv if argv is not None else sys.argv[1:])])
        (args.out / "throughput.md").write_text(
            "\n".join(header)
            + f"\n\n{table}\n\nRegenerate: `{invocation}`\n\nEach run's command: [runs.txt](runs.txt).\n"
        )
        (args.out / "runs.txt").write_text("\n".join(command_lines) + "\n")
        title = f"{Path(args.script).name}, {args.env_id}, {args.local_num_envs} envs/rank, {platform.node()}"
        plot(rows, title, args.out / "sps_vs_world_size.png")
        print(f"wrote {args.out / 'throughput.md'}, runs.txt and {args.out / 'sps_vs_world_size.png'}")
    return 0


def profile_configuration(args, variants, ws: int, cores, rows: list[dict]) -> list[dict]:
    """The profile of one rank of each script measured at world size `ws`, with that run's SPS and ceiling."""
    from benchmark import profile_rollout  # imports torch: only when profiling

    default = next((name for name, flags in variants if not flags), None)  # the profile runs the defaults
    ceiling = next((r["sps"] for r in rows if r["world_size"] == ws and r["name"] == CEILING), np.nan)
    profiles = []
    for script, name in [(args.script, default), *((s, Path(s).name) for s in args.compare)]:
        n, steps, iterations = args.local_num_envs, args.num_steps, args.profile_iterations
        cudagraphs = cudagraphs_flag(args.extra)  # the profile follows the runs' --cudagraphs
        result = profile_rollout.profile_rank(script, args.env_id, ws, n, steps, iterations, cores, cudagraphs)
        if result is None:
            print(f"  ws={ws} {Path(script).name}: not profiled (not an Atari PPO script)", flush=True)
            continue
        real = next((r["sps"] for r in rows if r["world_size"] == ws and r["name"] == name), np.nan)
        profiles.append(dict(world_size=ws, script=Path(script).name, num_envs=n, real_sps=real, ceiling=ceiling))
        profiles[-1] |= result
        print(f"  ws={ws} {Path(script).name}: profiled rank {result['sps']:.0f} steps/s", flush=True)
    return profiles


def cudagraphs_flag(flags: list[str]) -> bool | None:
    """The runs' --cudagraphs (True) or --no-cudagraphs (False), the last one given; None: the script's default."""
    given = [f == "--cudagraphs" for f in flags if f in ("--cudagraphs", "--no-cudagraphs")]
    return given[-1] if given else None


if __name__ == "__main__":
    sys.exit(main())
