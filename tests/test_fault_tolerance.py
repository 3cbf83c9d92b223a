"""Fault tolerance of ppo_multigpu.py through its real command lines: a worker killed under torchrun
--max-restarts, SIGTERM/SIGUSR1 preemption and --resume, bad checkpoints, an unwritable run
directory, a full disk while saving, and a stalled rank. docs/fault_tolerance.md describes what is
promised; each test injects one fault and checks exit code, message, checkpoint and TensorBoard steps.
"""

import hashlib
import os
import re
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_one_line_error,
    child_pids,
    finish,
    launch,
    only_run_dir,
    read_scalars,
    start,
    wait_until,
)

SCRIPT = "ppo_multigpu.py"
STEPS_PER_ITER = 2 * 2 * 16  # 2 ranks x --local-num-envs 2 x --num-steps 16
TINY = ["--local-num-envs", 2, "--num-steps", 16, "--num-minibatches", 2, "--update-epochs", 1]
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see docs/fault_tolerance.md, elastic restarts


def tiny(iterations, runs_dir, *extra, steps_per_iter=STEPS_PER_ITER):
    return [*TINY, "--total-timesteps", iterations * steps_per_iter, "--runs-dir", runs_dir, *extra]


def load(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def first_checkpoint(runs_dir):
    found = list(Path(runs_dir).glob("*/checkpoint.pt"))
    return found[0] if found else None


def assert_steps_complete(run_dir, iterations, steps_per_iter=STEPS_PER_ITER):
    """One TensorBoard point per iteration: no step missing, none twice (purge_step after restarts)."""
    scalars = read_scalars(run_dir)
    for tag in ("losses/value_loss", "charts/learning_rate"):
        steps = [s for s, _ in scalars[tag]]
        assert steps == [i * steps_per_iter for i in range(1, iterations + 1)], (tag, steps)
    # the annealed learning rate continues where it stopped: frac = 1 - (iteration - 1) / num_iterations
    for step, lr in scalars["charts/learning_rate"]:
        expected = 2.5e-4 * (1 - (step // steps_per_iter - 1) / iterations)
        assert lr == pytest.approx(expected, rel=1e-5), (step, lr)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-rank run (3 iterations): its run directory, holding checkpoint.pt."""
    runs = tmp_path_factory.mktemp("finished")
    proc = launch(SCRIPT, tiny(3, runs), nproc=2, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return only_run_dir(runs)


def test_sigkill_of_a_worker_restarts_and_finishes_exactly(tmp_path):
    iterations = 40
    proc = start(
        SCRIPT,
        tiny(iterations, tmp_path, "--checkpoint-every", 2),
        torchrun_args=["--standalone", "--nproc_per_node=2", "--max-restarts=1"],
        env=ELASTIC_ENV,
    )
    wait_until(lambda: first_checkpoint(tmp_path), 120, proc, "first checkpoint")
    os.kill(child_pids(proc.pid)[0], signal.SIGKILL)  # rank 0 (TensorBoard writer, store host), mid-run
    result = finish(proc, 240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert re.search(r"resuming at iteration \d+, global step \d+", result.stdout), output
    run_dir = only_run_dir(tmp_path)  # the restart found the same run directory
    assert load(run_dir / "checkpoint.pt")["global_step"] == iterations * STEPS_PER_ITER
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2  # one per attempt
    assert_steps_complete(run_dir, iterations)


@pytest.mark.parametrize(
    "env, pattern",
    [
        ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, r"--max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
        ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, r"--max-restarts needs a run name .*--rdzv-id"),
    ],
    ids=["shared-store", "no-run-id"],
)
def test_max_restarts_that_could_not_resume_are_refused(tmp_path, env, pattern):
    # the variables torchrun --max-restarts=1 sets for its workers (a real torchrun launch would print
    # the error once per attempt, and cost a launch per attempt)
    env = {**env, "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RUN_ID": "none"}
    proc = launch(SCRIPT, tiny(3, tmp_path, steps_per_iter=32), nproc=0, env=env, timeout=60)
    assert_one_line_error(proc, pattern, SCRIPT)
    assert not any(tmp_path.iterdir())


def test_sigterm_to_torchrun_saves_then_resume_finishes(tmp_path):
    iterations = 40
    args = tiny(iterations, tmp_path / "runs", "--checkpoint-every", 2, "--track")
    env = {"WANDB_DIR": str(tmp_path / "wandb-dir")}
    (tmp_path / "wandb-dir").mkdir()
    proc = start(SCRIPT, args, nproc=2, env=env)
    wait_until(lambda: first_checkpoint(tmp_path / "runs"), 120, proc, "first checkpoint")
    os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards SIGTERM to every worker
    result = finish(proc, 120)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output  # torchrun's own code after a signal; the workers exit 75
    lines = [line for line in output.splitlines() if line.startswith("ppo_multigpu: preempted")]
    assert len(lines) == 1, output
    stopped_at = int(re.search(r"at iteration (\d+)", lines[0]).group(1))
    run_dir = only_run_dir(tmp_path / "runs")
    ckpt = load(run_dir / "checkpoint.pt")
    assert ckpt["iteration"] == stopped_at < iterations
    assert ckpt["global_step"] == stopped_at * STEPS_PER_ITER
    assert ckpt["wandb_run_id"]

    # only --resume: the other flags (budget, sizes, --track, ...) come from the checkpoint
    resumed = launch(SCRIPT, ["--resume", run_dir], nproc=2, env=env, timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming at iteration {stopped_at + 1}" in resumed.stdout
    assert only_run_dir(tmp_path / "runs") == run_dir
    final = load(run_dir / "checkpoint.pt")
    assert final["global_step"] == iterations * STEPS_PER_ITER
    assert final["wandb_run_id"] == ckpt["wandb_run_id"]  # W&B resumed the same run
    wandb_runs = list((tmp_path / "wandb-dir").glob("wandb/offline-run-*"))
    assert wandb_runs and all(p.name.endswith(ckpt["wandb_run_id"]) for p in wandb_runs), wandb_runs
    assert_steps_complete(run_dir, iterations)


def test_sigusr1_to_a_plain_python_run_exits_75(tmp_path):
    """srun-style launch: the signal reaches the process itself, whose exit code the user sees."""
    iterations = 300
    steps = 2 * 16
    proc = start(SCRIPT, tiny(iterations, tmp_path, "--checkpoint-every", 2, steps_per_iter=steps), nproc=0)
    wait_until(lambda: first_checkpoint(tmp_path), 120, proc, "first checkpoint")
    os.kill(proc.pid, signal.SIGUSR1)
    result = finish(proc, 120)
    assert result.returncode == 75, result.stdout + result.stderr
    assert re.search(r"preempted by a signal at iteration \d+ .*--resume", result.stderr), result.stderr
    ckpt = load(first_checkpoint(tmp_path))
    assert ckpt["global_step"] == ckpt["iteration"] * steps < iterations * steps


def corrupt(kind: str, source: Path, target: Path) -> str:
    """Write a bad checkpoint of `kind` at `target`; return the --env-id to resume with."""
    data = source.read_bytes()
    if kind == "truncated":
        target.write_bytes(data[: len(data) // 2])
    elif kind == "garbage":
        target.write_bytes(os.urandom(len(data)))
    elif kind == "other-script":
        torch.save({"script": "other", "args": {"env_id": "CartPole-v1"}}, target)
    elif kind == "incomplete":
        torch.save({"script": "ppo_multigpu", "args": {"env_id": "CartPole-v1"}}, target)
    else:
        shutil.copy(source, target)
    return "Acrobot-v1" if kind == "other-env" else "CartPole-v1"


@pytest.mark.parametrize(
    "kind, pattern",
    [
        ("truncated", r"--resume: .*checkpoint.pt is truncated or corrupt .*left as it is"),
        ("garbage", r"--resume: .*checkpoint.pt is truncated or corrupt"),
        ("other-script", r"was written by 'other', not ppo_multigpu"),
        ("incomplete", r"lacks agent, global_step, iteration, optimizer, rng, sizes, world_size"),
        ("other-env", r"trained CartPole-v1, not --env-id Acrobot-v1"),
        ("missing", r"--resume: no checkpoint at .*nowhere"),
    ],
)
def test_bad_checkpoint_is_one_line_and_left_untouched(tmp_path, finished_run, kind, pattern):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ckpt = run_dir / "checkpoint.pt"
    env_id = corrupt(kind, finished_run / "checkpoint.pt", ckpt)
    before = sha256(ckpt)
    resume = tmp_path / "nowhere" if kind == "missing" else run_dir
    nproc = 2 if kind == "truncated" else 0  # one 2-rank case: the error travels from rank 0 to rank 1
    args = tiny(6, tmp_path / "runs", "--env-id", env_id, "--resume", resume, steps_per_iter=32 * max(nproc, 1))
    proc = launch(SCRIPT, args, nproc=nproc, timeout=120)
    assert_one_line_error(proc, pattern, SCRIPT)
    assert proc.returncode != 0
    assert sha256(ckpt) == before and sorted(os.listdir(run_dir)) == ["checkpoint.pt"]


def test_resume_with_another_world_size_is_refused(tmp_path, finished_run):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = sha256(run_dir / "checkpoint.pt")
    proc = launch(SCRIPT, [*tiny(6, tmp_path, steps_per_iter=32), "--resume", run_dir], nproc=0, timeout=120)
    assert_one_line_error(proc, r"written with world size 2 .*relaunch with 2 processes", SCRIPT)
    assert sha256(run_dir / "checkpoint.pt") == before


def test_unwritable_run_directory_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # even root cannot create a directory under a regular file
    proc = launch(SCRIPT, tiny(3, blocker / "runs"), nproc=2, timeout=120)
    assert_one_line_error(proc, r"cannot write to the run directory .*a-file/runs/.*: Not a directory", SCRIPT)
    assert blocker.read_text() == "not a directory"


def test_invalid_dist_timeout_is_one_line(tmp_path):
    proc = launch(SCRIPT, [*tiny(3, tmp_path, steps_per_iter=32), "--dist-timeout", 0], nproc=0, timeout=60)
    assert_one_line_error(proc, r"--dist-timeout must be positive", SCRIPT)


def test_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path, finished_run):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    ckpt = run_dir / "checkpoint.pt"
    before = sha256(ckpt)
    limit = ckpt.stat().st_size // 2  # room for event files, not for a checkpoint

    def small_disk():  # runs in the child: Python ignores SIGXFSZ, so writes past the limit raise EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = tiny(6, tmp_path / "runs", "--checkpoint-every", 1, "--resume", run_dir)
    proc = start(SCRIPT, args, nproc=2, preexec_fn=small_disk)
    result = finish(proc, 120)
    assert_one_line_error(
        result, r"could not write .*checkpoint.pt \(File too large\); the previous checkpoint is intact", SCRIPT
    )
    assert sha256(ckpt) == before
    assert not list(run_dir.glob("checkpoint.pt.tmp*"))
    # rank 1 stopped too, on the broadcast error (exit 2), or on torchrun's SIGTERM once rank 0 had exited
    assert re.search(r"rank      : 1 \(local_rank: 1\)\n\s+exitcode  : (2|-15) ", result.stderr), result.stderr


def test_a_stalled_rank_ends_the_job_with_one_line(tmp_path):
    proc = start(SCRIPT, tiny(1000, tmp_path, "--checkpoint-every", 2, "--dist-timeout", 3), nproc=2)
    wait_until(lambda: first_checkpoint(tmp_path), 120, proc, "first checkpoint")
    rank0, rank1 = child_pids(proc.pid)
    os.kill(rank1, signal.SIGSTOP)  # stalls without dying: only the timeout can tell
    wait_until(lambda: not os.path.exists(f"/proc/{rank0}"), 60, proc, "rank 0 to give up")
    os.kill(rank1, signal.SIGKILL)  # torchrun would do this itself after its 30 s shutdown grace
    result = finish(proc, 60)
    assert_one_line_error(
        result, r"rank 0 lost contact with the other ranks \(Timed out waiting 3000ms .*--dist-timeout", SCRIPT
    )
    assert "exitcode  : 4" in result.stderr, result.stderr
