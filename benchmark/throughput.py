"""Steady-state throughput (global agent steps/s) of a script, and the env-only ceiling beside it.

    # Breakout, 2 ranks x 4 envs, 128 steps, 4 minibatches, 4 epochs; two variants, 3 repeats each
    python -m benchmark.throughput --script cleanrl_ddp/ppo_atari_multigpu.py --world-sizes 2 \
        --variant default= --variant baseline="--no-channels-last" --repeats 3

Each run is the script's own command line (`torchrun --standalone` above world size 1) with a budget
of `--iterations` iterations. Throughput is read from what the run logged: the wall times and global
steps of its `charts/SPS` events after the first `--warmup` iterations (start-up, first-touch
allocations and the first checkpoint are excluded), so it is the rate of the steady state. The table
gives the median over `--repeats` (seeds 1, 2, ...) and, for reference, the median of the last
`charts/SPS` value the script itself logged (a moving window over its last 10 iterations).

The env-only ceiling steps the same vector env (built by the script's own `make_env`) with random
actions, one process per rank with the same env count and threads: no network, no learning. It is
measured in the same invocation, so a loaded machine depresses both alike.
"""

import argparse
import importlib
import inspect
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
from benchmark.harness import run_command

SPS_TAG = "charts/SPS"


def steady_sps(events: list[tuple[float, int, float]], warmup: int) -> float:
    """Global steps per second between the `warmup`-th and the last `charts/SPS` event."""
    if len(events) <= warmup:
        raise ValueError(f"only {len(events)} iterations logged; need more than --warmup {warmup}")
    (t0, s0, _), (t1, s1, _) = events[max(warmup, 1) - 1], events[-1]
    return (s1 - s0) / (t1 - t0)


def run_once(script, env_id, world_size, seed, variant_flags, sizes, iterations, timeout) -> dict:
    total = iterations * world_size * sizes["local_num_envs"] * sizes["num_steps"]
    extra = [
        *variant_flags,
        "--local-num-envs",
        str(sizes["local_num_envs"]),
        "--num-steps",
        str(sizes["num_steps"]),
        *sizes["extra"],
        "--total-timesteps",
        str(total),
        "--checkpoint-every",
        "0",
    ]
    with tempfile.TemporaryDirectory(prefix="throughput_") as runs_dir:
        cmd = run_command(script, env_id, seed, world_size, runs_dir, extra)
        env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        (run_dir,) = [p for p in Path(runs_dir).iterdir() if p.is_dir()]
        events = read_scalar_events(run_dir)[SPS_TAG]
    return dict(command=shlex.join(cmd), events=events)


# Env-only ceiling: one process per rank stepping the script's own vector env with random actions
def make_vector_env(module, env_id: str, num_envs: int, num_threads: int):
    """The script's envs: `make_env` returning a vector env (Atari), or a thunk per env (gymnasium)."""
    params = inspect.signature(module.make_env).parameters
    if "num_envs" in params:
        kwargs = {"num_threads": num_threads} if "num_threads" in params else {}
        return module.make_env(env_id, num_envs, **kwargs)
    import gymnasium as gym

    return gym.vector.SyncVectorEnv([module.make_env(env_id) for _ in range(num_envs)])


def ceiling_worker(module_name, env_id, num_envs, num_threads, steps, rank, barrier, results):
    module = importlib.import_module(module_name)
    envs = make_vector_env(module, env_id, num_envs, num_threads)
    envs.reset(seed=rank * num_envs)
    rng = np.random.default_rng(rank)
    n = int(envs.single_action_space.n)
    for _ in range(20):  # warm up
        envs.step(rng.integers(0, n, size=num_envs))
    barrier.wait()
    start = time.perf_counter()
    for _ in range(steps):
        envs.step(rng.integers(0, n, size=num_envs))
    results.put((steps * num_envs, time.perf_counter() - start))
    envs.close()


def env_ceiling(script, env_id, world_size, num_envs, steps) -> float:
    """Global random-action steps/s of `world_size` processes, each with the env setup of one rank."""
    module_name = f"cleanrl_ddp.{Path(script).stem}"
    num_threads = max(1, len(os.sched_getaffinity(0)) // world_size)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world_size), ctx.Queue()
    procs = [
        ctx.Process(
            target=ceiling_worker, args=(module_name, env_id, num_envs, num_threads, steps, r, barrier, results)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    done = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return sum(s for s, _ in done) / max(t for _, t in done)


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant takes NAME=FLAGS (FLAGS may be empty), got {text!r}")
    return name, shlex.split(flags)


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
        help="other scripts (e.g. an outside baseline accepting the same size flags) run the same way, as extra rows",
    )
    parser.add_argument("--local-num-envs", type=int, default=4)
    parser.add_argument("--num-steps", type=int, default=128)
    parser.add_argument("--iterations", type=int, default=14, help="iterations per run (the budget)")
    parser.add_argument("--warmup", type=int, default=4, help="first iterations left out of the steady rate")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration (seeds 1..N); median")
    parser.add_argument("--ceiling-steps", type=int, default=1000, help="vector-env steps per process (0 = skip)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    parser.add_argument("extra", nargs="*", help="more flags for the script, after `--`")
    args = parser.parse_args(argv)
    variants = args.variant or [("default", [])]
    sizes = dict(local_num_envs=args.local_num_envs, num_steps=args.num_steps, extra=args.extra)

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {args.script} on {args.env_id}: {platform.node()}, {len(os.sched_getaffinity(0))} cores ({cpu})")
    print(f"# {args.iterations} iterations per run, steady rate after {args.warmup}; median of {args.repeats}")
    rows, commands = [], {}
    for ws in args.world_sizes:
        runs = [(args.script, name, flags) for name, flags in variants]
        runs += [(script, Path(script).name, []) for script in args.compare]
        for script, name, flags in runs:
            sps, last = [], []
            for rep in range(args.repeats):
                out = run_once(script, args.env_id, ws, rep + 1, flags, sizes, args.iterations, args.timeout)
                sps.append(steady_sps(out["events"], args.warmup))
                last.append(out["events"][-1][2])
                commands[(ws, name)] = out["command"]
                print(f"  ws={ws} {name} seed={rep + 1}: {sps[-1]:.0f} steps/s", flush=True)
            rows.append((ws, name, statistics.median(sps), statistics.median(last), sps))
        if args.ceiling_steps:
            ceiling = env_ceiling(args.script, args.env_id, ws, args.local_num_envs, args.ceiling_steps)
            rows.append((ws, "env-only ceiling (random actions)", ceiling, float("nan"), [ceiling]))
            print(f"  ws={ws} env-only ceiling: {ceiling:.0f} steps/s", flush=True)

    print()
    print("| world size | variant | global SPS (steady, median) | last charts/SPS (median) | runs |")
    print("|---|---|---|---|---|")
    for ws, name, med, last, all_sps in rows:
        last_text = "" if np.isnan(last) else f"{last:.0f}"
        print(f"| {ws} | {name} | {med:.0f} | {last_text} | {', '.join(f'{s:.0f}' for s in all_sps)} |")
    print()
    for (ws, name), cmd in commands.items():
        print(f"# ws={ws} {name}: {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
