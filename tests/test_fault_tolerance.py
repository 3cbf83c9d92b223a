"""Fault tolerance of the scripts through their real command lines: a worker killed under torchrun
--max-restarts, SIGTERM/SIGUSR1 preemption and --resume, a resumed run equal to an uninterrupted one, bad
checkpoints, a full disk while saving, and a stalled rank. docs/runtime.md
describes what is promised; each test injects one fault and checks exit code, message, checkpoint and
TensorBoard steps.

The mechanisms live once, in cleanrl_ddp/runtime.py (unit-tested in tests/test_runtime.py), so each fault runs
as a whole script once, against ppo_multigpu.py. Only what goes through a script's own state runs for the
other scripts too: SIGTERM and --resume, and the exact resume of the scripts whose envs pickle (SCRIPTS, EXACT).
"""

import importlib.util
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    REPO,
    assert_one_line_error,
    batch_exit_codes,
    batch_job,
    batch_output,
    child_pids,
    file_sha256,
    finish,
    free_port,
    launch,
    launch_batch,
    main_error,
    main_exit,
    main_output,
    only_run_dir,
    read_scalars,
    start,
    wait_until,
)

PIPES = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
load = partial(torch.load, map_location="cpu", weights_only=True)  # a checkpoint, as data
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see docs/runtime.md, elastic restarts


@dataclass(frozen=True)
class Script:
    """A script that carries the fault-tolerance core, and the flags of its tiniest run."""

    name: str
    env_id: str
    other_env_id: str  # one this script accepts, to resume a checkpoint of `env_id` with
    tiny: tuple  # every rank steps `local_steps` env steps per iteration
    local_steps: int
    learning_rate: float | None = 2.5e-4  # the default, for the schedule check (None: not annealed)
    needs: str = ""  # a module the script imports beyond the test extra: its tests skip without it
    tags: tuple = ("losses/value_loss", "charts/learning_rate")  # logged once per iteration

    @property
    def stem(self) -> str:
        return self.name.removesuffix(".py")

    def steps(self, iterations, nproc=2) -> int:
        """The global steps of `iterations` iterations with `nproc` processes: the unit of --total-timesteps and of
        every periodic flag (--checkpoint-every, --sync-check-every, --eval-every)."""
        return iterations * self.local_steps * max(nproc, 1)

    def args(self, iterations, runs_dir, *extra, nproc=2, env_id=None) -> list:
        """A run of `iterations` iterations with `nproc` processes (0: plain python, one process)."""
        total = self.steps(iterations, nproc)
        run = ["--env-id", env_id or self.env_id, *self.tiny, "--total-timesteps", total, "--runs-dir", runs_dir]
        return [*run, *extra]


PPO = Script(
    "ppo_multigpu.py",
    "CartPole-v1",
    "Acrobot-v1",
    ("--local-num-envs", 2, "--num-steps", 16, "--num-minibatches", 2, "--update-epochs", 1),
    local_steps=2 * 16,
)
CONTINUOUS = Script(
    "ppo_continuous_action_multigpu.py",
    "InvertedPendulum-v5",
    "Hopper-v5",
    ("--num-steps", 32, "--num-minibatches", 2, "--update-epochs", 1),
    local_steps=32,
    learning_rate=3e-4,
    needs="mujoco",
)
ATARI = Script(
    "ppo_atari_multigpu.py",
    "BreakoutNoFrameskip-v4",
    "PongNoFrameskip-v4",
    ("--local-num-envs", 1, "--num-steps", 16, "--num-minibatches", 1, "--update-epochs", 1),
    local_steps=16,
)
# the rollout in two halves of one env each; its checkpoint and resume lines are the synchronous script's
ASYNC = Script(
    "ppo_atari_async_multigpu.py",
    "BreakoutNoFrameskip-v4",
    "PongNoFrameskip-v4",
    ("--local-num-envs", 2, "--num-steps", 4, "--num-minibatches", 1, "--update-epochs", 1),
    local_steps=2 * 4,
)
# PQN: the PPO scripts' sizes and their checkpoint and resume lines (classic: envs saved as data, so exact)
PQN = Script(
    "pqn_multigpu.py",
    "CartPole-v1",
    "Acrobot-v1",
    PPO.tiny,
    local_steps=PPO.local_steps,
    tags=("losses/td_loss", "charts/epsilon"),
)
PQN_ATARI = Script(
    "pqn_atari_multigpu.py",
    "BreakoutNoFrameskip-v4",
    "PongNoFrameskip-v4",
    ATARI.tiny,
    local_steps=ATARI.local_steps,
    tags=("losses/td_loss", "charts/epsilon"),
)
# --log-every counts global steps (4 per iteration here): every iteration logs; updates start at global step 64
# (after a resume, 64 steps later)
DQN = Script(
    "dqn_atari_multigpu.py",
    "BreakoutNoFrameskip-v4",
    "PongNoFrameskip-v4",
    ("--local-num-envs", 2, "--buffer-size", 32, "--learning-starts", 64, "--train-frequency", 16)
    + ("--local-batch-size", 4, "--target-network-frequency", 32, "--log-every", 4),
    local_steps=2,
    learning_rate=None,
    tags=("charts/epsilon", "charts/updates"),
)
# SAC on Pendulum-v1 (1 env per rank): updates from global step 16 (16 more after a resume: the buffer refill), the
# actor and log_alpha after every 2nd; every iteration (2 global steps) logs
SAC = Script(
    "sac_continuous_action_multigpu.py",
    "Pendulum-v1",
    "MountainCarContinuous-v0",
    ("--local-num-envs", 1, "--buffer-size", 64, "--learning-starts", 16, "--local-batch-size", 4)
    + ("--updates-per-iteration", 2, "--log-every", 2),
    local_steps=1,
    learning_rate=None,
    tags=("losses/alpha", "charts/updates"),
)

# TD3 as SAC: the actor and both target networks after every 2nd critic update
TD3 = Script(
    "td3_continuous_action_multigpu.py",
    "Pendulum-v1",
    "MountainCarContinuous-v0",
    SAC.tiny,
    local_steps=1,
    learning_rate=None,
    tags=("charts/updates", "charts/actor_updates"),
)


def case(script: Script, *values, name: str = "") -> pytest.param:
    """One parametrization for `script`, named after it, skipped where it cannot run."""
    marks = []
    if script.needs and importlib.util.find_spec(script.needs) is None:
        marks.append(pytest.mark.skip(reason=f"{script.name} needs {script.needs}"))
    return pytest.param(script, *values, id="-".join(filter(None, [script.stem, name])), marks=marks)


# The scripts that run SIGTERM and --resume (their own state), and those whose resume is exact (their envs pickle)
SCRIPTS = [case(s) for s in (PPO, CONTINUOUS, ATARI, ASYNC, DQN, SAC, TD3, PQN, PQN_ATARI)]
EXACT = (PPO, CONTINUOUS, PQN, SAC, TD3)


def sigterm_iterations(script: Script) -> int:
    """The length of a script's SIGTERM runs: room for the signal to land mid-run, after the first checkpoint
    (iteration 2); off-policy: for updates after the resume's refill; the Atari scripts' iterations are long enough
    (a CNN update each) for 20 to leave that room."""
    return {SAC: 60, TD3: 60, ATARI: 20, ASYNC: 20, PQN_ATARI: 20}.get(script, 40)


def first_checkpoint(runs_dir):
    return next(Path(runs_dir).glob("*/checkpoint.pt"), None)


def events_past_checkpoint(runs_dir) -> bool:
    """Whether the run's event file holds a step beyond its checkpoint's (events are synced before each checkpoint,
    so a crash now leaves logged steps that the restart must not log twice)."""
    path = first_checkpoint(runs_dir)
    if path is None:
        return False
    step = load(path)["global_step"]  # replaced atomically: never a torn file
    return any(s > step for s, _ in read_scalars(path.parent).get("charts/SPS", []))


def assert_steps_complete(run_dir, iterations, script: Script, nproc=2):
    """One TensorBoard point per iteration: no step missing, none twice (purge_step after restarts)."""
    steps_per_iter = script.local_steps * nproc
    scalars = read_scalars(run_dir)
    for tag in script.tags:
        steps = [s for s, _ in scalars[tag]]
        assert steps == [i * steps_per_iter for i in range(1, iterations + 1)], (tag, steps)
    if script.learning_rate is None:
        return
    # the annealed learning rate continues where it stopped: frac = 1 - (iteration - 1) / num_iterations
    for step, lr in scalars["charts/learning_rate"]:
        expected = script.learning_rate * (1 - (step // steps_per_iter - 1) / iterations)
        assert lr == pytest.approx(expected, rel=1e-5), (step, lr)


def snapshot(directory: Path) -> dict:
    """Every file under `directory`: name -> (size, modification time in ns)."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


def test_sigkill_of_a_worker_restarts_and_finishes_exactly(tmp_path):
    """Rank 0 SIGKILLed mid-run: torchrun restarts the workers, which resume and log every step once. Before, while
    rank 0 is alive (stopped), a second launch of the same run stops in one line naming the holder of the run
    directory's lease, having written nothing; the restart takes the lease over (docs/runtime.md, the run
    directory's lease; a requeue passes through it in
    test_slurm_job_requeued_onto_fewer_tasks_resumes_with_the_same_global_batch)."""
    iterations = 40
    flags = PPO.args(iterations, tmp_path, "--checkpoint-every", PPO.steps(2), "--run-name", "shared")
    torchrun = ["--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    proc = start(PPO.name, flags, torchrun_args=torchrun, env=ELASTIC_ENV)
    # events past the checkpoint reached the file: the restart must drop them (purge_step), every step once
    wait_until(lambda: events_past_checkpoint(tmp_path), 120, proc, "events past the first checkpoint")
    rank0 = child_pids(proc.pid)[0]  # the TensorBoard writer, store host and lease holder
    os.kill(rank0, signal.SIGSTOP)  # alive, writing nothing while the second launch runs (rank 1 waits for it)
    run_dir = tmp_path / "shared"
    before = snapshot(run_dir)
    second = launch(PPO.name, flags, nproc=2, timeout=120)
    assert "exitcode  : 2 " in second.stderr, second.stderr  # the workers' 2; torchrun's own is 1
    holder = rf"host {re.escape(socket.gethostname())}, pid {rank0}, launch [0-9a-f-]+"
    assert_one_line_error(second, rf"{run_dir} is in use by a live run \({holder}\)", PPO.name)
    assert snapshot(run_dir) == before  # nothing written, not even a probe or an event file
    os.kill(rank0, signal.SIGKILL)  # mid-run, without a word: the OS drops its lease
    result = finish(proc, 240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert re.search(r"resuming at iteration \d+, global step \d+", result.stdout), output
    assert only_run_dir(tmp_path) == run_dir  # the restart found the same run directory
    assert f"pid {rank0}, " not in (run_dir / "lease").read_text()  # and holds its lease
    assert load(run_dir / "checkpoint.pt")["global_step"] == iterations * 2 * PPO.local_steps
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2  # one per attempt
    assert_steps_complete(run_dir, iterations, PPO)


def elastic_agent(runs_dir, iterations, port, *extra) -> subprocess.Popen:
    """One torchrun agent that plays a node of an elastic job of 1 to 2 nodes (one worker each)."""
    torchrun_args = ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    torchrun_args += ["--rdzv-id=elastic-test", "--max-restarts=3", "--monitor-interval=0.2"]
    # once one node is there, wait 1 s (not 30) for more; a node silent for 5 s (not 15) is gone
    torchrun_args += ["--rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"]
    flags = PPO.args(iterations, runs_dir, "--checkpoint-every", 1, *extra)
    return start(PPO.name, flags, torchrun_args=torchrun_args, env=ELASTIC_ENV)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def checkpoint_world_size(runs_dir) -> int:
    return load(first_checkpoint(runs_dir))["world_size"] if first_checkpoint(runs_dir) else 0


def signal_pending(pid: int, signum: int) -> bool:
    """Whether `signum` waits to be delivered to process `pid` (a stopped process keeps it pending)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return bool((int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)) & (1 << (signum - 1)))


def test_elastic_job_grows_when_a_node_joins_and_finishes_alone_after_losing_it(tmp_path):
    """Two torchrun agents on one machine play two nodes (`--nnodes=1:2`, c10d rendezvous).
    - A starts alone: world size 1, 2 envs.
    - B joins: A's agent stops its worker with SIGTERM (a checkpoint, exit 75), and both agents start workers at
      world size 2, one env each (their states split from A's), which resume from it, the replicas compared after
      every iteration. (A's worker is paused from its first checkpoint until that SIGTERM waits, so the run cannot
      end before B has joined.)
    - B and its worker are SIGKILLed after a checkpoint at world size 2: A's worker loses its peer (exit 4), A's
      agent restarts it, and it resumes at world size 1 with both envs.
    The job finishes with exit 0 at exactly the requested global step, every TensorBoard step once."""
    iterations, port = 30, free_port()  # iterations of 32 global steps: the batch of 2 envs x 16 steps
    agent_a = elastic_agent(tmp_path, iterations // 2, port, "--sync-check-every", 1)
    wait_until(lambda: listening(port), 60, agent_a, "A's rendezvous store")  # A hosts it: the node that stays
    wait_until(lambda: checkpoint_world_size(tmp_path) == 1, 120, agent_a, "a checkpoint at world size 1")
    (worker,) = child_pids(agent_a.pid)
    os.kill(worker, signal.SIGSTOP)
    agent_b = elastic_agent(tmp_path, iterations // 2, port, "--sync-check-every", 1)
    wait_until(lambda: signal_pending(worker, signal.SIGTERM), 120, agent_b, "A's agent to stop its worker")
    os.kill(worker, signal.SIGCONT)
    wait_until(lambda: checkpoint_world_size(tmp_path) == 2, 120, agent_a, "a checkpoint at world size 2")
    grown = load(first_checkpoint(tmp_path))  # A's two envs went on mid-episode, one on each rank
    assert grown["args"]["local_num_envs"] == 1 and [len(state[0]) for state in grown["rank_state"]] == [1, 1]
    for pid in [*child_pids(agent_b.pid), agent_b.pid]:  # the node dies: its agent and its worker
        os.kill(pid, signal.SIGKILL)
    result, lost = finish(agent_a, 120), finish(agent_b, 30)
    output = result.stdout + result.stderr + lost.stdout + lost.stderr
    assert result.returncode == 0, output
    assert re.search(r"preempted by a signal at global step \d+", output), output
    assert "world size 1 -> 2: global sizes kept" in output and "world size 2 -> 1: global sizes kept" in output
    assert re.search(r"rank \d lost contact with the other ranks", output), output
    run_dir = only_run_dir(tmp_path)
    final = load(run_dir / "checkpoint.pt")
    assert final["world_size"] == 1 and final["args"]["local_num_envs"] == final["sizes"]["num_envs"] == 2
    assert final["global_step"] == iterations * PPO.local_steps
    assert_steps_complete(run_dir, iterations, PPO, nproc=1)


def requeue_attempt(tmp_path, job_id: int, ntasks: int, restart: int, flags) -> subprocess.Popen:
    """One attempt of benchmark/slurm/requeue.sbatch as SLURM starts it, with its variables. A change of the node
    count between attempts (the file's --nodes=1-2) needs two hosts: tests/test_slurm.py runs every other path on a
    real SLURM, this one runs with stand-ins for `srun` and `scontrol` (tests/slurm_standins: tasks on this
    machine with the variables a real srun sets, requeues logged)."""
    path = f"{REPO / 'tests' / 'slurm_standins'}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1", "SCRIPT": f"cleanrl_ddp/{PPO.name}"}
    env |= dict(SLURM_JOB_ID=str(job_id), SLURM_NTASKS=str(ntasks), SLURM_RESTART_COUNT=str(restart))
    env |= dict(SLURM_JOB_NODELIST="localhost", SCONTROL_LOG=str(tmp_path / "scontrol.log"))
    command = ["bash", str(REPO / "benchmark" / "slurm" / "requeue.sbatch"), *map(str, flags)]
    return subprocess.Popen(command, cwd=REPO, env=env, text=True, start_new_session=True, **PIPES)


def test_slurm_job_requeued_onto_fewer_tasks_resumes_with_the_same_global_batch(tmp_path):
    """requeue.sbatch: SIGUSR1 before the time limit stops both tasks with a checkpoint (exit 75) and the job
    requeues itself; the requeued job gets 1 task instead of 2, finds its run by the job id and finishes with
    the same global envs, batch and schedule, at exactly the requested global step."""
    iterations, job_id = 40, 20000 + os.getpid() % 20000  # the job id also sets MASTER_PORT
    flags = PPO.args(iterations, tmp_path / "runs", "--checkpoint-every", 1)  # 2 tasks x 2 envs
    first = requeue_attempt(tmp_path, job_id, 2, 0, flags)
    wait_until(lambda: first_checkpoint(tmp_path / "runs"), 120, first, "first checkpoint")
    tasks = [pid for srun in child_pids(first.pid) for pid in child_pids(srun)]
    assert len(tasks) == 2, tasks
    for pid in tasks:  # what SLURM's --signal=USR1@90 does 90 s before the time limit
        os.kill(pid, signal.SIGUSR1)
    result = finish(first, 120)
    assert result.returncode == 75, result.stdout + result.stderr
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {job_id}\n"

    result = finish(requeue_attempt(tmp_path, job_id, 1, 1, flags), 180)  # SLURM found one free task
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world size 2 -> 1: global sizes kept" in result.stdout
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {job_id}\n"  # finished: no second requeue
    run_dir = only_run_dir(tmp_path / "runs")
    assert run_dir.name.endswith(f"__slurm{job_id}.0")  # the job and its step: a requeue starts again at step 0
    final = load(run_dir / "checkpoint.pt")
    assert final["world_size"] == 1 and final["sizes"]["num_envs"] == 4
    assert final["global_step"] == iterations * 2 * PPO.local_steps
    assert_steps_complete(run_dir, iterations, PPO)


@pytest.mark.parametrize(
    "env, pattern",
    [
        ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, r"--max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
        ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, r"--max-restarts needs a run name .*--rdzv-id"),
    ],
    ids=["shared-store", "no-run-id"],
)
def test_max_restarts_that_could_not_resume_are_refused(tmp_path, monkeypatch, env, pattern):
    # in this process, with the variables torchrun --max-restarts=1 sets for its workers (a real torchrun launch
    # would print the error once per attempt, and cost a launch per attempt)
    env = {**env, "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RUN_ID": "none"}
    assert re.search(pattern, main_error(monkeypatch, PPO.name, *PPO.args(3, tmp_path, nproc=0), env=env))
    assert not any(tmp_path.iterdir())


def assert_same_bits(a, b, where="") -> None:
    """Nested dicts/lists of tensors and numbers are equal, bit for bit."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_bits(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_bits(x, y, f"{where}/{i}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, where


def sigterm_run(script: Script, runs_dir: Path) -> list:
    """The SIGTERM test's run: 2 ranks, a checkpoint every 2 iterations."""
    return script.args(sigterm_iterations(script), runs_dir, "--checkpoint-every", script.steps(2))


def stop_when_checkpointed(script: Script, runs_dir: Path, proc, pids) -> None:
    """SIGTERM to the processes `pids()` once the run has a checkpoint (SAC, TD3: once updates began, so that the
    resume must carry the update counters on)."""
    wait_until(lambda: first_checkpoint(runs_dir), 120, proc, "first checkpoint")
    if script in (SAC, TD3):
        wait_until(lambda: load(first_checkpoint(runs_dir))["num_updates"], 120, proc, "updates checkpointed")
    for pid in pids():
        os.kill(pid, signal.SIGTERM)


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory):
    """stopped_runs(script): (runs directory, output, exit codes) of the SIGTERM run of `script`, stopped once it had a
    checkpoint. ppo_multigpu.py's SIGTERM goes to torchrun, which forwards it to every worker (the exit code is
    torchrun's own); the other scripts' runs share one 2-rank launch (`launch_batch`: one after another in the same
    ranks), the signal sent to both ranks as SLURM signals every task (the exit codes are the ranks'). Each is started
    the first time it is asked for."""
    done = {}

    def stop_ppo() -> None:
        runs_dir = tmp_path_factory.mktemp("stopped-ppo") / "runs"
        proc = start(PPO.name, sigterm_run(PPO, runs_dir), nproc=2)
        stop_when_checkpointed(PPO, runs_dir, proc, lambda: [proc.pid])
        result = finish(proc, 120)
        done[PPO.name] = runs_dir, result.stdout + result.stderr, [result.returncode]

    def stop_the_others() -> None:
        scripts = [s.values[0] for s in SCRIPTS if s.values[0] is not PPO and not s.marks]
        dirs = {s.name: tmp_path_factory.mktemp(f"stopped-{s.stem}") for s in scripts}
        jobs = [batch_job(s.name, sigterm_run(s, dirs[s.name] / "runs"), dirs[s.name]) for s in scripts]
        jobs_file = tmp_path_factory.mktemp("stopped") / "jobs.json"
        proc = launch_batch(jobs, 2, jobs_file, 0, start_only=True)
        try:
            for s in scripts:
                stop_when_checkpointed(s, dirs[s.name] / "runs", proc, lambda: child_pids(proc.pid))
                stopped = dirs[s.name]
                wait_until(lambda d=stopped: None not in batch_exit_codes(d, 2), 120, proc, f"{s.stem} to stop")
        finally:
            result = finish(proc, 120)
        assert result.returncode == 0, result.stdout + result.stderr
        for s in scripts:
            done[s.name] = dirs[s.name] / "runs", batch_output(dirs[s.name], 2), batch_exit_codes(dirs[s.name], 2)

    def stopped_run(script: Script) -> tuple:
        if script.name not in done:
            stop_ppo() if script is PPO else stop_the_others()
        return done[script.name]

    return stopped_run


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory, stopped_runs):
    """resumed_runs(script): for an EXACT script, (the stopped run's directory, resumed on 2 ranks with `--resume`
    alone; a copy of it as it was stopped; what the resume printed; the run directory of the same 2-rank run without
    the stop, finished). The resumes and the uninterrupted runs of all EXACT scripts share one 2-rank launch
    (`launch_batch`: one after another in the same two ranks), started the first time one is asked for."""
    done = {}

    def resumed_run(script: Script) -> tuple:
        if not done:
            scripts = [s for s in EXACT if not s.needs or importlib.util.find_spec(s.needs)]
            jobs, runs = [], {}
            for s in scripts:
                finished = tmp_path_factory.mktemp(f"finished-{s.stem}")
                args = s.args(sigterm_iterations(s), finished / "runs", "--checkpoint-every", 0)
                jobs.append(batch_job(s.name, args, finished))
                run_dir = only_run_dir(stopped_runs(s)[0])
                stopped = tmp_path_factory.mktemp(f"as-stopped-{s.stem}") / run_dir.name
                shutil.copytree(run_dir, stopped)
                resumed = tmp_path_factory.mktemp(f"resumed-{s.stem}")
                jobs.append(batch_job(s.name, ["--resume", run_dir], resumed))  # the other flags: the checkpoint's
                runs[s.name] = run_dir, stopped, resumed, finished
            jobs_file = tmp_path_factory.mktemp("resumed") / "jobs.json"
            proc = launch_batch(jobs, 2, jobs_file, 120 * len(jobs))
            for s in scripts:
                run_dir, stopped, resumed, finished = runs[s.name]
                for outdir in (resumed, finished):
                    output = batch_output(outdir, 2)
                    assert proc.returncode == 0 and batch_exit_codes(outdir, 2) == [0, 0], proc.stderr + output
                done[s.name] = run_dir, stopped, batch_output(resumed, 2), only_run_dir(finished / "runs")
        return done[script.name]

    return resumed_run


@pytest.fixture(scope="module")
def finished_runs(resumed_runs):
    """finished_runs(script): the run directory of a finished 2-rank run of an EXACT script: the SIGTERM test's run
    without the stop (`sigterm_iterations`), launched with the resumes (`resumed_runs`), and the source of the bad
    checkpoints below."""
    return lambda script: resumed_runs(script)[3]


@pytest.mark.parametrize("script", SCRIPTS)
def test_sigterm_then_resume_finishes_and_equals_the_uninterrupted_run(
    tmp_path, monkeypatch, capsys, stopped_runs, resumed_runs, script
):
    """SIGTERM: every rank stops at the same iteration after a checkpoint (exit 75): sent to torchrun, which forwards
    it to every worker (ppo_multigpu.py), or to every rank as SLURM does (the others, `stopped_runs`). Where each rank's
    envs are checkpointed (EXACT), `--resume` alone on 2 ranks finishes the run bit for bit as the same run without
    the stop: weights, Adam's moments, every rank's RNG streams and envs (and the continuous script's statistics).
    Restoring only the weights fails this. The same checkpoint resumes on one rank (plain python): the global
    batch, schedules and counters go on, every TensorBoard step logged once (the 2-rank resume of the scripts that
    reset their envs adds nothing to this: its weights, counters and steps are checked the same way on one rank; a
    resume onto more ranks: the elastic test below), here in this process (helpers.main_output: as the plain-python
    command runs it). (W&B continuing the same run on resume: tests/test_runtime.py.)"""
    iterations, steps_per_iter = sigterm_iterations(script), 2 * script.local_steps
    runs_dir, output, exit_codes = stopped_runs(script)
    # torchrun's own code after a signal (its workers exit 75); the ranks' own codes
    assert exit_codes == ([1] if script is PPO else [75, 75]), output
    lines = [line for line in output.splitlines() if line.startswith(f"{script.stem}: preempted")]
    assert len(lines) == 1, output
    stopped_step = int(re.search(r"at global step (\d+);", lines[0]).group(1))
    stopped_at = stopped_step // steps_per_iter
    run_dir = only_run_dir(runs_dir)
    if script in EXACT:  # the checkpoint as it was stopped: run_dir is resumed on 2 ranks below
        run_dir, stopped, resumed, finished = resumed_runs(script)
    else:
        stopped = run_dir
    ckpt = load(stopped / "checkpoint.pt")
    assert ckpt["iteration"] == stopped_at < iterations
    assert ckpt["global_step"] == stopped_step == stopped_at * steps_per_iter
    if script in (ATARI, ASYNC, DQN, PQN_ATARI):  # ALE's vector env cannot be pickled: a resume reseeds it
        assert ckpt["rank_state"] == [None, None]

    def assert_resumed(stdout: str, run_dir: Path, world_size: int) -> dict:
        """The resume at `world_size` went on from the checkpoint to exactly the requested step."""
        assert f"resuming at iteration {stopped_at + 1}" in stdout
        assert only_run_dir(run_dir.parent) == run_dir
        final = load(run_dir / "checkpoint.pt")
        assert final["world_size"] == world_size and global_sizes(final) == global_sizes(ckpt)
        assert final["global_step"] == iterations * steps_per_iter
        assert_steps_complete(run_dir, iterations, script)
        return final

    if script in EXACT:
        final = assert_resumed(resumed, run_dir, 2)
        expected = load(finished / "checkpoint.pt")
        assert expected["global_step"] == final["global_step"]
        assert final.keys() == expected.keys()
        for key in expected.keys() - {"args", "versions", "wandb_run_id"}:  # learned state, RNGs, envs, buffers
            assert_same_bits(final[key], expected[key], key)
        run_dir = stopped

    # On one rank (a requeue onto fewer GPUs): the per-rank flags are derived again from the global sizes, so the
    # global envs and batch, the schedules and the global step continue.
    resumed = main_output(monkeypatch, capsys, script.name, "--resume", run_dir)
    assert "world size 2 -> 1: global sizes kept" in resumed, resumed
    final = assert_resumed(resumed, run_dir, 1)
    num_envs = final["sizes"]["num_envs"]
    assert final["args"]["local_num_envs"] == num_envs
    if script in (PPO, CONTINUOUS, PQN):  # every env went on from where it stopped, now all on rank 0
        assert [len(state[0]) for state in final["rank_state"]] == [num_envs]
    if script in (SAC, TD3):  # the counters went on from the checkpoint, and updates waited for the buffer refill
        assert f"updates restart at global step {stopped_step + 16}" in resumed
        refilled = iterations - stopped_at - 16 // steps_per_iter  # iterations with updates after the resume
        assert final["num_updates"] == ckpt["num_updates"] + 2 * max(refilled, 0) > ckpt["num_updates"] > 0


def test_sigusr1_to_a_plain_python_run_exits_75(tmp_path):
    """srun-style launch: the signal reaches the process itself, whose exit code the user sees."""
    iterations = 300
    every = PPO.steps(2, nproc=0)
    proc = start(PPO.name, PPO.args(iterations, tmp_path, "--checkpoint-every", every, nproc=0), nproc=0)
    wait_until(lambda: first_checkpoint(tmp_path), 120, proc, "first checkpoint")
    os.kill(proc.pid, signal.SIGUSR1)
    result = finish(proc, 120)
    assert result.returncode == 75, result.stdout + result.stderr
    assert re.search(r"preempted by a signal at global step \d+; .*--resume", result.stderr), result.stderr
    ckpt = load(first_checkpoint(tmp_path))
    assert ckpt["global_step"] == ckpt["iteration"] * PPO.local_steps < iterations * PPO.local_steps


def corrupt(kind: str, source: Path, target: Path, script: Script) -> str:
    """Write a bad checkpoint of `kind` at `target`; return the --env-id to resume with."""
    data = source.read_bytes()
    if kind == "truncated":
        target.write_bytes(data[: len(data) // 2])
    elif kind == "garbage":
        target.write_bytes(os.urandom(len(data)))
    elif kind == "other-script":
        torch.save({"script": "other", "args": {"env_id": script.env_id}}, target)
    elif kind == "incomplete":
        torch.save({"script": script.stem, "args": {"env_id": script.env_id}}, target)
    elif kind in ("malformed", "other-shape", "other-moments"):  # one rank's RNG streams gone; a weight, a moment
        ckpt = load(source)  # of another shape (a hand-made file: torch loads moments of any shape)
        if kind == "malformed":
            ckpt["rng"].pop()
        else:
            entry = ckpt["agent"] if kind == "other-shape" else ckpt["optimizer"]["state"][0]
            entry["critic.0.weight" if kind == "other-shape" else "exp_avg"] = torch.zeros(3, 3)
        torch.save(ckpt, target)
    else:
        shutil.copy(source, target)
    return script.other_env_id if kind == "other-env" else script.env_id


@pytest.mark.parametrize(
    "script, kind, pattern",
    [
        case(PPO, "truncated", r"--resume: .*checkpoint.pt is truncated or corrupt .*left as it is", name="truncated"),
        case(PPO, "garbage", r"--resume: .*checkpoint.pt is truncated or corrupt", name="garbage"),
        case(PPO, "other-script", r"was written by 'other', not ppo_multigpu", name="other-script"),
        case(
            PPO,
            "incomplete",
            r"lacks agent, agent_kwargs, global_step, iteration, optimizer, rank_state, rng, sizes, world_size",
            name="incomplete",
        ),
        case(PPO, "malformed", r"has a malformed world_size, rng, rank_state \(one item per rank\)", name="malformed"),
        case(PPO, "other-shape", r"does not fit this script \(RuntimeError: .*size mismatch for c", name="other-shape"),
        case(PQN, "other-moments", r"does not fit this script \(ValueError: optimizer state \{'exp_a", name="moments"),
        case(PPO, "other-env", r"trained CartPole-v1, not --env-id Acrobot-v1", name="other-env"),
        case(PPO, "missing", r"--resume: no checkpoint at .*nowhere", name="missing"),
    ],
)
def test_bad_checkpoint_is_one_line_and_left_untouched(
    tmp_path, monkeypatch, capsys, finished_runs, script, kind, pattern
):
    """In this process (helpers.main_exit): exit 2 and one line. Rank 0 loads the checkpoint and every rank learns its
    refusal in the same broadcast (runtime.load_run) as a live run's lease refusal, which the SIGKILL test's second
    launch shows at 2 ranks; a state that does not fit fails alike on every rank as it is loaded."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ckpt = run_dir / "checkpoint.pt"
    env_id = corrupt(kind, finished_runs(script) / "checkpoint.pt", ckpt, script)
    before = file_sha256(ckpt)
    resume = tmp_path / "nowhere" if kind == "missing" else run_dir
    more = 2 * sigterm_iterations(script) + 3  # one process: more than the 2-rank run, a resume that would train
    args = script.args(more, tmp_path / "runs", "--resume", resume, nproc=0, env_id=env_id)
    code, stderr = main_exit(monkeypatch, capsys, script.name, *args)
    assert code == 2 and re.fullmatch(f"{script.stem}: error: .*{pattern}.*", stderr.strip()), stderr
    held = ["lease"] if kind in ("other-shape", "other-moments") else []  # taken before the state was loaded
    assert file_sha256(ckpt) == before and sorted(os.listdir(run_dir)) == ["checkpoint.pt", *held]


def global_sizes(ckpt: dict) -> dict:
    """The sizes a change of world size keeps: all but the per-rank ones."""
    return {k: v for k, v in ckpt["sizes"].items() if not k.startswith("local_") and k != "world_size"}


@pytest.mark.parametrize(
    "nproc, flags, pattern",
    [
        (3, (), r"the checkpoint's num_envs 4 cannot be split evenly over 3 ranks; .*world sizes: 1, 2, 4$"),
        (0, ("--local-num-envs", 3), r"--local-num-envs 3 on 1 rank\(s\) changes the checkpoint's num_envs 4; omit it"),
    ],
    ids=["does-not-divide", "other-local-num-envs"],
)
def test_resume_that_cannot_keep_the_global_batch_is_one_line(
    tmp_path, monkeypatch, finished_runs, nproc, flags, pattern
):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_runs(PPO), run_dir)
    before = file_sha256(run_dir / "checkpoint.pt")
    if nproc:
        assert_one_line_error(
            launch(PPO.name, ["--resume", run_dir, *flags], nproc=nproc, timeout=120), pattern, PPO.name
        )
    else:  # in this process
        assert re.search(pattern, main_error(monkeypatch, PPO.name, "--resume", run_dir, *flags))
    assert file_sha256(run_dir / "checkpoint.pt") == before


@pytest.mark.parametrize("script", [case(PPO)])
def test_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path, finished_runs, script):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_runs(script), run_dir)
    ckpt = run_dir / "checkpoint.pt"
    before = file_sha256(ckpt)
    limit = ckpt.stat().st_size // 2  # room for event files, not for a checkpoint

    def small_disk():  # runs in the child: Python ignores SIGXFSZ, so writes past the limit raise EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    more = sigterm_iterations(script) + 3  # than the finished run: its next iteration saves
    args = script.args(more, tmp_path / "runs", "--checkpoint-every", 1, "--resume", run_dir)
    proc = start(script.name, args, nproc=2, preexec_fn=small_disk)
    result = finish(proc, 120)
    assert_one_line_error(
        result, r"could not write .*checkpoint.pt \(File too large\); the previous checkpoint is intact", script.name
    )
    assert file_sha256(ckpt) == before
    assert not list(run_dir.glob("checkpoint.pt.tmp*"))
    # rank 1 stopped too, on the broadcast error (exit 2), or on torchrun's SIGTERM once rank 0 had exited
    assert re.search(r"rank      : 1 \(local_rank: 1\)\n\s+exitcode  : (2|-15) ", result.stderr), result.stderr


def test_a_stalled_rank_ends_the_job_with_one_line(tmp_path):
    flags = PPO.args(1000, tmp_path, "--checkpoint-every", PPO.steps(2), "--dist-timeout", 3)
    proc = start(PPO.name, flags, nproc=2)
    wait_until(lambda: first_checkpoint(tmp_path), 120, proc, "first checkpoint")
    rank0, rank1 = child_pids(proc.pid)
    os.kill(rank1, signal.SIGSTOP)  # stalls without dying: only the timeout can tell
    wait_until(lambda: not os.path.exists(f"/proc/{rank0}"), 60, proc, "rank 0 to give up")
    os.kill(rank1, signal.SIGKILL)  # torchrun would do this itself after its 30 s shutdown grace
    result = finish(proc, 60)
    assert_one_line_error(
        result, r"rank 0 lost contact with the other ranks \(Timed out waiting 3000ms .*--dist-timeout", PPO.name
    )
    assert "exitcode  : 4" in result.stderr, result.stderr
