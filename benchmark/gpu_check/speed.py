"""The speed rows, each with the machine to itself: the Atari PPO's steady SPS with no speed flags next to the
env-only ceiling, where one iteration's time goes, CleanRL's and LeanRL's own scripts (`throughput`); a script with
--no-cudagraphs against --cudagraphs (`graphs-speed:`, one implementation for every script, sized by its row in
`Sizes.graphs_speed`) and its default path against --compile (`compile-speed:`); one off-policy env step part by
part (`profile:`); LeanRL's SAC and TD3 beside ours (`leanrl:`); the env layer alone (`env-sweep:`).

Every row that measures "ours" runs the scripts with no speed flags, the default path, and says which path that
was (read from the run's flags.json: CUDA graphs or eager, and --compile); a comparison passes its flag explicitly
on both sides (`--cudagraphs` against `--no-cudagraphs`), never relying on a default."""

import importlib.util
import json
import os
import re
import shlex
import sys
from pathlib import Path

from benchmark.gpu_check.correctness import COMPILE_LOGS, compile_notes, final_step
from benchmark.gpu_check.runner import Check, Result, timed
from benchmark.gpu_check.sizes import ASYNC, ATARI, ENV_ID, REPO, Speed, has_flag, missing

GOALS = {8: 0.85, 64: 0.90}  # the Atari PPO's share of the env-only ceiling with no speed flags; measured, not asserted
CLEANRL_GOAL = 5.0  # this script's SPS over CleanRL's at CleanRL's configuration
LEANRL_GOAL = 1.3  # this script's SPS over LeanRL's compile + CUDA-graph script's at 8 envs
# LeanRL's own SAC and TD3 (ported, benchmark/peers/leanrl_*.py) with its fastest flags, on graphs-speed:'s env
LEANRL_FLAGS = "--env-id HalfCheetah-v5 --learning-starts 1000 --total-timesteps 3000 --seed 1 --compile --cudagraphs"


def path(args: dict, device: str) -> str:
    """The speed path a run took, from its flags: CUDA graphs (captured only on CUDA) or eager, and --compile."""
    graphs = "CUDA graphs" if args.get("cudagraphs") and device == "cuda" else "eager"
    return graphs + (" + --compile" if args.get("compile") else "")


def run_args(run_dir: Path) -> dict:
    """The flags a run took, as its flags.json records them (the script's defaults included)."""
    return json.loads((run_dir / "flags.json").read_text())["args"]


def compare_speed(c: Check, name: str, script: str, row: Speed, variants: list[str]) -> Result:
    """`script` at world size 1 with each of `variants` ("" is the default path), one after another in this call:
    each ends at its exact step; their steady SPS (the first `row.warmup` logged points left out), the path each took,
    and each ratio to the first."""
    from benchmark import throughput as tp
    from benchmark.events import read_scalar_events

    figures, first = [], None
    for variant in variants:
        label = variant or "default"
        run_dir = (
            c.runs / f"check-{name.replace(':', '-').removesuffix('.py')}-{'-'.join(variant.split()) or 'default'}"
        )
        cmd = c.command(script, [*shlex.split(row.flags), *shlex.split(variant), "--seed", 1, *c.device_flags])
        cmd += ["--runs-dir", str(c.runs), "--run-name", run_dir.name, "--checkpoint-every", "0"]
        log_name = f"{name} {label}"
        code, out, seconds = c.run(log_name, cmd, env={**c.env, **COMPILE_LOGS} if "--compile" in variant else None)
        if code != 0:
            why = f"killed at its limit of {c.limit(name):.0f} s" if code is None else f"exited {code}"
            return c.failed(name, code, out, f"the {label} run {why}", log_name)
        step, _ = final_step(run_dir)
        if step != row.total:
            return c.failed(name, code, out, f"the {label} run ended at global step {step}, not {row.total}", log_name)
        skips, recompiles = compile_notes(out)
        if skips and c.device == "cuda":
            return c.failed(name, code, out, f"compiled graphs ran without CUDA graphs: {'; '.join(skips)}", log_name)
        sps = tp.steady_sps(read_scalar_events(run_dir)[tp.SPS_TAG], row.warmup)
        args = run_args(run_dir)
        first = first or sps
        figure = f"{sps:,.0f} SPS {label} ({path(args, c.device)}, {seconds:.0f} s)"
        figure += f" = {sps / first:.2f}x" if variant != variants[0] else ""
        figure += f", {recompiles} recompilation(s)" if "--compile" in variant else ""
        figures.append(figure)
    return Result(
        name,
        "ok",
        f"{args['env_id']}, world size 1, steady SPS after the first {row.warmup} logged points: {'; '.join(figures)}; "
        f"all at global step {row.total}",
    )


def check_graphs_speed(c: Check, script: str) -> Result:
    """`graphs-speed:<script>`: --no-cudagraphs, then --cudagraphs (then the row's other variants), steady SPS."""
    name = f"graphs-speed:{script}"
    row = c.sizes.graphs_speed.get(script)
    if row is None:
        return Result(name, "FAIL", "no row for it in Sizes.graphs_speed (benchmark/gpu_check/sizes.py): add its flags")
    if missing(script) or ("-v5" in row.flags and importlib.util.find_spec("mujoco") is None):
        return Result(name, "skip", missing(script) or "HalfCheetah-v5 needs mujoco (pip install -e '.[mujoco]')")
    if not has_flag(script, "cudagraphs"):
        return Result(name, "skip", "its Args has no cudagraphs field: no --cudagraphs path to time")
    return compare_speed(c, name, script, row, ["--no-cudagraphs", "--cudagraphs", *row.more])


def check_compile_speed(c: Check, script: str) -> Result:
    """`compile-speed:<script>`: the default path, then with --compile (the compile's seconds in its run's)."""
    name = f"compile-speed:{script}"
    return compare_speed(c, name, script, c.sizes.compile_speed[script], ["", "--compile"])


THROUGHPUT = """
import json, sys
from benchmark import profile_rollout, throughput as tp
script, env_id, num_envs, num_steps, iterations, warmup, ceiling_steps, timeout, profiled, *extra = sys.argv[1:]
sizes = dict(local_num_envs=int(num_envs), num_steps=int(num_steps), extra=extra)
out = tp.run_once(script, env_id, 1, 1, [], sizes, int(iterations), float(timeout))
sps = tp.steady_sps(out["events"][tp.SPS_TAG], int(warmup))
update_share = tp.time_shares(out["events"], int(warmup))[0]
ceiling = tp.env_ceiling(script, env_id, 1, int(num_envs), int(ceiling_steps)) if int(ceiling_steps) else None
result = dict(sps=sps, ceiling=ceiling, update_share=update_share, args=out["args"])
if int(profiled):  # the script's default path, as the run above took it
    module = "cleanrl_ddp." + script.rsplit("/", 1)[-1].removesuffix(".py")
    result["profile"] = profile_rollout.profile_iterations(module, env_id, int(num_envs), int(num_steps), int(profiled))
print("throughput:", json.dumps(result))
"""


def check_throughput(c: Check) -> list[Result]:
    """benchmark/throughput.py's steady SPS of the Atari PPO at world size 1 with no speed flags, and the env-only
    ceiling, in this call; at the first env count also the profile and CleanRL's and LeanRL's scripts."""
    s, results = c.sizes, []
    for num_envs in s.throughput_envs:
        name = f"throughput {num_envs} envs"
        first = num_envs == s.throughput_envs[0]  # profiled too: where one iteration's time goes
        args = [num_envs, s.throughput_num_steps, s.throughput_iterations, s.throughput_warmup, s.ceiling_steps]
        args += [c.limit(name), s.profile_iterations if first else 0]
        cmd = [sys.executable, "-c", THROUGHPUT, str(REPO / "cleanrl_ddp" / ATARI), ENV_ID, *args]
        code, out, seconds = c.run(name, [*map(str, cmd), *c.device_flags])
        figures = re.search(r"^throughput: (.*)$", out, re.MULTILINE)
        if code != 0 or figures is None:
            results.append(c.failed(name, code, out))
            results[-1].seconds = seconds
            continue
        figures = json.loads(figures.group(1))
        sps, ceiling, ours = figures["sps"], figures["ceiling"], f"{ATARI} ({path(figures['args'], c.device)})"
        goal = GOALS.get(num_envs)
        goal_text = f" (goal {100 * goal:.0f}%: {'met' if sps >= goal * ceiling else 'not met'})" if goal else ""
        figure = f"{ours} {sps:,.0f} SPS = {100 * sps / ceiling:.0f}% of the env-only ceiling {ceiling:,.0f} of this"
        figure += f" call{goal_text}; the update {100 * figures['update_share']:.0f}% of the time"
        results.append(Result(name, "ok", figure, seconds))
        if "profile" in figures:
            results.append(Result(f"profile {num_envs} envs", "ok", profile_figure(figures["profile"]), seconds))
        if first:
            results.append(timed(check_cleanrl, c, num_envs, sps, ours))
            results.append(timed(check_leanrl_atari, c, num_envs, sps, ours))
            results.append(check_async(c, num_envs, ceiling))
    return results


def check_async(c: Check, num_envs: int, ceiling: float) -> Result:
    """The asynchronous Atari PPO (its env halves stepped while the other half's policy step runs) with no speed
    flags, as `throughput` runs the synchronous one, against the synchronous env-only ceiling of this call: the
    overlap pays where it runs above it."""
    s, name = c.sizes, f"async {num_envs} envs"
    args = [num_envs, s.throughput_num_steps, s.throughput_iterations, s.throughput_warmup, 0, c.limit(name), 0]
    cmd = [sys.executable, "-c", THROUGHPUT, str(REPO / "cleanrl_ddp" / ASYNC), ENV_ID, *args]
    code, out, seconds = c.run(name, [*map(str, cmd), *c.device_flags])
    figures = re.search(r"^throughput: (.*)$", out, re.MULTILINE)
    if code != 0 or figures is None:
        result = c.failed(name, code, out)
        result.seconds = seconds
        return result
    figures = json.loads(figures.group(1))
    sps, met = figures["sps"], "met" if figures["sps"] > ceiling else "not met"
    figure = f"{ASYNC} ({path(figures['args'], c.device)}) {sps:,.0f} SPS = {100 * sps / ceiling:.0f}% of the "
    figure += f"synchronous env-only ceiling {ceiling:,.0f} of this call (goal: above it: {met})"
    return Result(name, "ok", figure, seconds)


def profile_figure(profile: dict) -> str:
    """benchmark/profile_rollout.py's split of one iteration (each part timed to the device's end), as a line: with
    the policy step per env step and the update per iteration, under the path it took."""
    from benchmark.profile_rollout import PART_NAMES, PARTS

    total, parts = profile["total"], profile["seconds"]
    how = "CUDA graphs" if profile["captured"] else "eager"
    split = ", ".join(f"{PART_NAMES[p]} {1000 * parts[p]:.0f} ms ({100 * parts[p] / total:.0f}%)" for p in PARTS)
    per_step = 1000 * parts["policy"] / profile["num_steps"]
    return (
        f"one iteration of {ATARI} alone ({how}), timed part by part: {1000 * total:.0f} ms = {split}; the policy "
        f"step {per_step:.2f} ms per env step, the update {1000 * parts['update']:.0f} ms per iteration"
    )


def check_cleanrl(c: Check, num_envs: int, our_sps: float, ours: str = ATARI) -> Result:
    """CleanRL's own ppo_atari_multigpu.py (benchmark/peers/cleanrl_ppo_atari_multigpu.py, ported to gymnasium 1.x,
    or a checkout's) at 1 process x `num_envs` envs: it takes no --runs-dir, so it runs in a folder of its own and
    writes runs/<name> there; a checkout's `cleanrl_utils` comes from PYTHONPATH (the folder above the script's)."""
    name = f"cleanrl {num_envs} envs"
    if not c.cleanrl_script:
        return Result(name, "skip", "no --cleanrl-script (or CLEANRL_PPO_ATARI_MULTIGPU): CleanRL's script not run")
    from benchmark import throughput as tp
    from benchmark.events import read_scalar_events

    s, script = c.sizes, Path(c.cleanrl_script).expanduser().resolve()
    if not script.is_file():
        return Result(name, "FAIL", f"--cleanrl-script {script}: no such file")
    workdir = c.out / "cleanrl"
    workdir.mkdir(exist_ok=True)
    total = s.cleanrl_iterations * num_envs * s.throughput_num_steps
    cmd = [sys.executable, str(script), "--env-id", ENV_ID, "--seed", "1", "--local-num-envs", str(num_envs)]
    cmd += ["--num-steps", str(s.throughput_num_steps), "--total-timesteps", str(total)]
    cmd += [] if c.device == "cuda" else ["--no-cuda"]
    env = {**c.env, "PYTHONPATH": os.pathsep.join([str(script.parent.parent), c.env["PYTHONPATH"]])}
    code, out, _ = c.run(name, cmd, env=env, cwd=workdir)
    run_dirs = sorted((workdir / "runs").glob("*")) if (workdir / "runs").is_dir() else []
    if code != 0 or not run_dirs:
        return c.failed(name, code, out)
    try:
        sps = tp.steady_sps(read_scalar_events(run_dirs[-1])[tp.SPS_TAG], s.throughput_warmup)
    except (KeyError, ValueError) as e:
        return c.failed(name, code, out, f"no steady charts/SPS: {e}")
    met = "met" if our_sps / sps >= CLEANRL_GOAL else "not met"
    figure = f"CleanRL's {script.name} {sps:,.0f} SPS; {ours} {our_sps / sps:.2f}x of it"
    return Result(name, "ok", f"{figure} (goal {CLEANRL_GOAL:.0f}x: {met})")


def check_leanrl_atari(c: Check, num_envs: int, our_sps: float, ours: str = ATARI) -> Result:
    """LeanRL's own PPO Atari script (benchmark/peers/leanrl_ppo_atari.py, ported), `--compile --cudagraphs` on
    CUDA, at 1 process x `num_envs` envs x the throughput's steps: its own steady speed (`speed: N sps`, from
    iteration 11 to 20) next to `our_sps`, the Atari PPO's in the same call. It needs EnvPool (1.2.7: Python >= 3.12)
    with its Atari ROMs (benchmark/offline_wheels.sh); without it, or without --leanrl-script, it is a skip line."""
    name = f"leanrl {num_envs} envs"
    if not c.leanrl_script:
        return Result(name, "skip", "no --leanrl-script: LeanRL's script not run")
    if importlib.util.find_spec("envpool") is None:
        return Result(name, "skip", "no envpool here (EnvPool 1.2.7 needs Python >= 3.12: benchmark/offline_wheels.sh)")
    s, script = c.sizes, Path(c.leanrl_script).expanduser().resolve()
    if not script.is_file():
        return Result(name, "FAIL", f"--leanrl-script {script}: no such file")
    workdir = c.out / "leanrl_ppo_atari"
    workdir.mkdir(exist_ok=True)
    total = s.leanrl_iterations * num_envs * s.throughput_num_steps
    cmd = [sys.executable, str(script), "--num-envs", str(num_envs), "--num-steps", str(s.throughput_num_steps)]
    cmd += ["--total-timesteps", str(total)] + (["--compile", "--cudagraphs"] if c.device == "cuda" else ["--no-cuda"])
    code, out, _ = c.run(name, cmd, cwd=workdir)
    speeds = re.findall(r"speed: *([\d.]+) sps", out)
    if code != 0 or not speeds:
        return c.failed(name, code, out, "" if code != 0 else "no `speed: N sps` in its output")
    sps, mode = float(speeds[-1]), "--compile --cudagraphs" if c.device == "cuda" else "eager"
    met = "met" if our_sps >= LEANRL_GOAL * sps else "not met"
    figure = f"LeanRL's {script.name} ({mode}) {sps:,.0f} SPS; {ours} {our_sps / sps:.2f}x of it"
    return Result(name, "ok", f"{figure} (goal {LEANRL_GOAL:g}x: {met})")


def check_profile(c: Check, script: str) -> list[Result]:
    """benchmark/profile_offpolicy.py: one env step of SAC or TD3 at world size 1, timed part by part, with
    --no-cudagraphs and, on CUDA, with --cudagraphs (on the CPU it would run the same functions eagerly)."""
    env_id, warmup, steps = c.sizes.offpolicy_profile
    if env_id.endswith("-v5") and importlib.util.find_spec("mujoco") is None:
        return Result(f"profile:{script}", "skip", f"{env_id} needs mujoco (pip install -e '.[mujoco]')")
    results = []
    for graphed in (False, True) if c.device == "cuda" else (False,):
        label = f"profile{' --cudagraphs' if graphed else ''}:{script}"
        cmd = [sys.executable, "-m", "benchmark.profile_offpolicy", "--script", script, "--env-id", env_id]
        cmd += ["--warmup", str(warmup), "--steps", str(steps), "--device", c.device]
        code, out, seconds = c.run(label, [*cmd, "--cudagraphs" if graphed else "--no-cudagraphs"])
        found = re.search(r"^profile: (.*)$", out, re.MULTILINE)
        results.append(
            c.failed(label, code, out) if code != 0 or found is None else Result(label, "ok", found.group(1))
        )
        results[-1].seconds = seconds
    return results


def check_leanrl(c: Check, script: str) -> Result:
    """LeanRL's SAC or TD3 (`--leanrl-sac-script`, `--leanrl-td3-script`) on HalfCheetah-v5 with --compile
    --cudagraphs, its own speed measure (SPS from 3 steps after learning starts, the last one its progress bar
    shows), next to ours with no speed flags on the flags of its graphs-speed: row, both in this check."""
    from benchmark import throughput as tp
    from benchmark.events import read_scalar_events

    algo = script.split("_")[0]
    name = f"leanrl:{script}"
    leanrl = c.leanrl_scripts.get(script)
    if not leanrl:
        return Result(name, "skip", f"no --leanrl-{algo}-script: LeanRL's script not run")
    if importlib.util.find_spec("torchrl") is None:
        return Result(name, "skip", "LeanRL's script needs torchrl (pip install --no-deps torchrl==0.14.1 hoptorch)")
    if importlib.util.find_spec("mujoco") is None:
        return Result(name, "skip", "HalfCheetah-v5 needs mujoco (pip install -e '.[mujoco]')")
    row, run_dir = c.sizes.graphs_speed[script], c.runs / f"check-leanrl-ours-{script.removesuffix('.py')}"
    cmd = c.command(script, [*shlex.split(row.flags), "--seed", 1, *c.device_flags])
    cmd += ["--runs-dir", str(c.runs), "--run-name", run_dir.name, "--checkpoint-every", "0"]
    code, out, ours_seconds = c.run(f"{name} ours", cmd)
    if code != 0:
        return c.failed(name, code, out, f"{script} exited {code}", f"{name} ours")
    ours = tp.steady_sps(read_scalar_events(run_dir)[tp.SPS_TAG], row.warmup)
    workdir = c.out / "leanrl"
    workdir.mkdir(exist_ok=True)
    flags = shlex.split(LEANRL_FLAGS) if c.device == "cuda" else [*shlex.split(LEANRL_FLAGS)[:-2], "--no-cuda"]
    if c.device == "cpu":  # a few updates, eagerly: the port runs
        flags[flags.index("--learning-starts") + 1], flags[flags.index("--total-timesteps") + 1] = "64", "110"
    code, out, seconds = c.run(name, [sys.executable, str(Path(leanrl).resolve()), *flags], cwd=workdir)
    speeds = re.findall(r"([\d.]+) sps", out)
    if code != 0 or not speeds:
        return c.failed(name, code, out)
    theirs = float(speeds[-1])
    how = "--compile --cudagraphs" if c.device == "cuda" else "eager"
    figure = f"LeanRL's {Path(leanrl).name} {how}: {theirs:,.1f} SPS ({seconds:.0f} s); {script} with no speed flags "
    figure += f"({path(run_args(run_dir), c.device)}) {ours:,.0f} SPS ({ours_seconds:.0f} s) = {ours / theirs:.2f}x"
    return Result(name, "ok", figure, seconds + ours_seconds)


def check_env_sweep(c: Check, num_envs: str) -> Result:
    """The env layer alone: `python -m benchmark.throughput --env-sweep N`, the random-action rate of ALE's vector
    env built by the Atari PPO's make_env for each num_threads and batch_size; its best settings."""
    name = f"env-sweep:{num_envs}"
    cmd = [sys.executable, "-m", "benchmark.throughput", "--script", str(REPO / "cleanrl_ddp" / ATARI)]
    cmd += ["--env-id", ENV_ID, "--env-sweep", num_envs, "--env-sweep-steps", str(c.sizes.env_sweep_steps)]
    code, out, seconds = c.run(name, cmd)
    best = re.search(r"^env-sweep \d+ envs best: (.*)$", out, re.MULTILINE)
    if code != 0 or best is None:
        return c.failed(name, code, out)
    return Result(name, "ok", best.group(1), seconds)


CHECKS = {"throughput": check_throughput, "graphs-speed": check_graphs_speed, "compile-speed": check_compile_speed}
CHECKS |= {"profile": check_profile, "leanrl": check_leanrl, "env-sweep": check_env_sweep}
