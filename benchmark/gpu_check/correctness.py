"""The checks that the CUDA paths run and match: every script at world size 1 (`script:`), 2 ranks sharing the GPU
(`gloo:`, `flat:`, `compile:`, `compile-flat:`), an NCCL process group at world size 1 (`nccl-1`) and NCCL's guard
against two ranks on one GPU (`nccl-guard`), the synchronizing CUDA operations (`sync-debug:`), a 2-rank run stopped
and resumed on one rank (`resume`), a GPU checkpoint evaluated (`evaluate`), and --cudagraphs bitwise equal to
--no-cudagraphs (`graphs:`, one implementation for every script, sized by its row in `Sizes.graphs`)."""

import os
import re
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from benchmark.gpu_check.runner import Check, Result, timed
from benchmark.gpu_check.sizes import ATARI, FEW_ITERATIONS, Graphs, has_flag, local_steps, missing

# torch's own logs of the compiled runs: a graph that runs without CUDA graphs ("skipping cudagraphs due to ...")
# and a function compiled again ("Recompiling function ...")
COMPILE_LOGS = {"TORCH_LOGS": "perf_hints,cudagraphs,recompiles"}
PREEMPTED = r"preempted by a signal at global step (\d+);"  # a run stopped by SIGTERM says so, and where


def torch_load(run_dir: Path) -> dict:
    import torch

    return torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)


def final_step(run_dir: Path) -> tuple[int, int]:
    """(global step, world size) of the run's checkpoint."""
    ckpt = torch_load(run_dir)
    return ckpt["global_step"], ckpt["world_size"]


def compile_notes(out: str) -> tuple[list[str], int]:
    """(the distinct reasons torch gave for running a compiled graph without CUDA graphs, the recompilations)."""
    skips = sorted(set(re.findall(r"skipping cudagraphs due to ([^\n]{0,150})", out)))
    return skips, len(re.findall(r"Recompiling function", out))


def check_script(c: Check, script: str) -> Result:
    name = f"script:{script}"
    if script not in FEW_ITERATIONS:
        return Result(name, "FAIL", "no row for it in FEW_ITERATIONS (benchmark/gpu_check/sizes.py): add its flags")
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
        # torch's 16 threads made it 49 s instead of about 10 (H200, 2026-11-26; docs/gpu.md)
        env = {**c.env, "OMP_NUM_THREADS": "1"} if device == "cpu" else None
        code, out, seconds = c.run(name, [*cmd, "--device", device], env=env)
        line = next((line for line in out.splitlines() if " return " in line and "±" in line), None)
        if code != 0 or line is None:
            results.append(c.failed(name, code, out))
        else:
            results.append(Result(name, "ok", line.split(": ", 1)[1][:110]))
        results[-1].seconds = seconds
    return results


def stop_after_checkpoint(c: Check, name: str, proc, run_dir: Path) -> None:
    """SIGTERM to `proc` (torchrun forwards it to every rank) once its run wrote its first checkpoint, unless it
    ended first or the check's time limit passed."""
    start = time.monotonic()
    while not (run_dir / "checkpoint.pt").exists() and proc.poll() is None:
        if time.monotonic() - start > c.limit(name):
            break
        time.sleep(0.05)
    if proc.poll() is None and (run_dir / "checkpoint.pt").exists():
        os.kill(proc.pid, signal.SIGTERM)


def check_resume(c: Check) -> Result:
    """A 2-rank gloo run stopped by SIGTERM after its first checkpoint, resumed by `--resume` alone at world size 1
    with the replica check on: it ends at exactly the requested global step."""
    name = "resume"
    s = c.sizes
    flags = shlex.split(s.resume_flags)
    total = s.resume_iterations * 2 * local_steps(s.resume_flags)
    run_dir = c.runs / "check-resume"
    cmd = c.command(ATARI, [*flags, "--total-timesteps", total, *c.device_flags, "--backend", "gloo"], nproc=2)
    cmd += ["--runs-dir", str(c.runs), "--run-name", run_dir.name, "--checkpoint-every", "1"]
    proc = c.start(name, cmd)
    stop_after_checkpoint(c, name, proc, run_dir)
    code, out = c.finish(name, proc)
    stopped = re.search(PREEMPTED, out)
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


def checkpoint_differences(a: Path, b: Path) -> tuple[list[str], int]:
    """Where two runs' final checkpoints differ in any bit, in every entry but the flags (`args`, which differ by
    --cudagraphs and the run's name): parameters, optimizer state, every rank's RNG streams (CUDA's included),
    counters and sizes. For each differing tensor its path and the largest difference relative to the tensor's
    largest magnitude; and the number of tensors compared."""
    import torch
    from torch.utils._pytree import keystr, tree_flatten_with_path

    ckpts = [{k: v for k, v in torch_load(p).items() if k != "args"} for p in (a, b)]
    leaves = [tree_flatten_with_path(ckpt)[0] for ckpt in ckpts]
    paths = [[keystr(path) for path, _ in entries] for entries in leaves]
    if paths[0] != paths[1]:
        return [f"other entries: {sorted(set(paths[0]) ^ set(paths[1]))[:4]}"], 0
    out, tensors = [], 0
    for (path, x), (_, y) in zip(*leaves, strict=True):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            tensors += 1
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                scale = x.double().abs().max().clamp_min(1e-30) if x.is_floating_point() else 1.0
                rel = float((x.double() - y.double()).abs().max() / scale) if x.shape == y.shape else float("inf")
                out.append(f"{keystr(path)} ({rel:.1e})")
        elif type(x) is not type(y) or x != y:
            out.append(keystr(path))
    return out, tensors


def graphs_runs(row: Graphs) -> dict:
    """The first runs of `graphs:` for a script's row, all at once: run -> (processes, its flags)."""
    runs = {"eager": (1, ["--no-cudagraphs"]), "graphs": (1, ["--cudagraphs"])}
    runs = {run: (1, [*flags, "--total-timesteps", row.total]) for run, (_, flags) in runs.items()}
    two_ranks = ["--total-timesteps", row.total2, "--backend", "gloo", "--sync-check-every", 1]
    for sync in row.ranks2:
        for graphed in (False, True) if sync == row.ranks2[0] else (True,):
            flag = "--cudagraphs" if graphed else "--no-cudagraphs"
            runs[f"{'graphs' if graphed else 'eager'}-2-{sync}"] = (2, [flag, "--grad-sync", sync, *two_ranks])
    return runs


def graphs_pairs(row: Graphs) -> list[tuple[str, str]]:
    """The runs of `graphs:` whose final checkpoints must be bitwise equal: at world size 1, the --cudagraphs run's
    checkpoint trained on with and without the flag, and at 2 ranks each --cudagraphs run against the first
    --grad-sync's --no-cudagraphs one."""
    pairs = [("eager", "graphs"), ("resumed-eager", "resumed-graphs")]
    return pairs + [(f"eager-2-{row.ranks2[0]}", f"graphs-2-{sync}") for sync in row.ranks2]


def check_graphs(c: Check, script: str) -> Result:
    """--cudagraphs against --no-cudagraphs from the same seeds (docs/gpu.md), the runs of the script's
    row in `Sizes.graphs`: at world size 1; on 2 ranks sharing the device (gloo) for each --grad-sync of the row,
    each against the first one's --no-cudagraphs run; and the --cudagraphs run's final checkpoint resumed with a
    larger --total-timesteps once with and once without the flag. Every pair's final checkpoints are bitwise equal
    (the same kernels replay, the same random numbers), every entry but the flags."""
    name, stem = f"graphs:{script}", script.removesuffix(".py")
    row = c.sizes.graphs.get(script)
    if row is None:
        return Result(name, "FAIL", "no row for it in Sizes.graphs (benchmark/gpu_check/sizes.py): add its flags")
    if missing(script):
        return Result(name, "skip", missing(script))
    if not has_flag(script, "cudagraphs"):
        return Result(name, "skip", "its Args has no cudagraphs field: no --cudagraphs path to compare")
    run_dir = {run: c.runs / f"check-graphs-{stem}-{run}" for pair in graphs_pairs(row) for run in pair}
    # its runs share the machine, as the checks of a step do: one thread a process (runner.step_env)
    env, procs = {**c.env, "OMP_NUM_THREADS": "1"}, {}
    for run, (nproc, extra) in graphs_runs(row).items():
        flags = [*shlex.split(row.flags), "--seed", 1, *c.device_flags, *extra, "--checkpoint-every", 0]
        cmd = c.command(script, [*flags, "--runs-dir", c.runs, "--run-name", run_dir[run].name], nproc)
        procs[run] = c.start(f"{name} {run}", cmd, env)
    outs = {"graphs": c.finish(f"{name} graphs", procs.pop("graphs"))}
    if outs["graphs"][0] == 0:  # its checkpoint trained on, with and without the flag, beside the runs still going
        for run, flag in (("resumed-eager", "--no-cudagraphs"), ("resumed-graphs", "--cudagraphs")):
            shutil.copytree(run_dir["graphs"], run_dir[run])
            flags = ["--resume", run_dir[run], flag, "--total-timesteps", 2 * row.total, *c.device_flags]
            procs[run] = c.start(f"{name} {run}", c.command(script, [*flags, "--checkpoint-every", 0]), env)
    outs |= {run: c.finish(f"{name} {run}", proc) for run, proc in procs.items()}
    for run, (code, out) in outs.items():  # every run finished first: none is left running
        if code != 0:
            return c.failed(name, code, out, f"the {run} run exited {code}", f"{name} {run}")
    tensors = []
    for a, b in graphs_pairs(row):
        differ, compared = checkpoint_differences(run_dir[a], run_dir[b])
        tensors.append(compared)
        if differ:
            why = f"{b} differs from {a} in {len(differ)} entries, largest relative difference: {'; '.join(differ[:4])}"
            return Result(name, "FAIL", why)
    two = f" and on 2 ranks ({', '.join(row.ranks2)}; global step {row.total2})" if row.ranks2 else ""
    return Result(
        name,
        "ok",
        f"--cudagraphs bitwise equal to --no-cudagraphs at world size 1 (global step {row.total}){two}, and its "
        f"checkpoint trained on to {2 * row.total} with and without it: every checkpoint entry but the flags "
        f"({tensors[0]} tensors at world size 1)",
    )


CHECKS = {"script": check_script, "gloo": check_gloo, "flat": check_flat, "compile": check_compile}
CHECKS |= {"compile-flat": check_compile_flat, "sync-debug": check_sync_debug, "nccl-1": check_nccl_one}
CHECKS |= {"nccl-guard": check_nccl_guard, "resume": check_resume, "evaluate": check_evaluate}
CHECKS |= {"graphs": check_graphs}
