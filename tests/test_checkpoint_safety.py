"""Checkpoints that are safe to load, and runs that never mix.

- A checkpoint is data: it loads with `torch.load(weights_only=True)`; the envs continue from their state as data.
- A file that carries code (a pickled object) is refused by `--resume`, by the automatic resume and by `evaluate`,
  and so is a saved `module:Env` id: the code never runs (a marker file it would write stays absent).
- One experiment, one run directory: same-second and same-SLURM-job launches, other flags, finished runs.
- Ctrl-C: the first SIGINT is a preemption (exit 75 with a checkpoint), a second one stops at once; the logs are
  closed on every way out.

In this process where a unit shows it; one command for --resume, one 2-rank run for SIGINT.
"""

import importlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
from helpers import (
    LAUNCH_VARS,
    REPO,
    assert_one_line_error,
    free_port,
    launch,
    main_error,
    main_output,
    only_run_dir,
    read_scalars,
    script_path,
    wait_until,
)

from cleanrl_ddp import checkpoint, env_state, evaluate
from cleanrl_ddp import launch as launcher
from cleanrl_ddp import runtime as rt
from cleanrl_ddp.run_dir import FLAGS_FILE


@dataclass
class Args(rt.RunArgs):
    """What a script's Args adds that the module reads, and one algorithm flag."""

    env_id: str = "CartPole-v1"
    exp_name: str = "test"
    seed: int = 1
    total_timesteps: int = 1000
    local_num_envs: int = 1
    learning_rate: float = 2.5e-4


@pytest.fixture
def clean_launch(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", ["script"])
    return monkeypatch


def one_rank(**flags) -> rt.Run:
    return rt.Run("ppo_multigpu", Args(**flags), 0, 1, torch.device("cpu"), None)


def train(tmp_path, iterations=2, **flags) -> rt.Run:
    """A run of the module alone: resume, open the logs, log and checkpoint `iterations` iterations, finish."""
    run = one_rank(runs_dir=str(tmp_path), **flags)
    rt.load_run(run, run.args)
    rt.open_run(run, rt.Sizes(world_size=1, num_envs=1, batch_size=10, num_iterations=100), None)
    for iteration in range(1, iterations + 1):
        rt.log(run, 10 * iteration, {"losses/x": 1.0}, dict(episode_return_sum=0.0, episode_length_sum=0, episodes=0))
        rt.save_checkpoint(run, iteration, 10 * iteration, None, agent={"w": torch.ones(2)})
    rt.finish_or_exit_preempted(run, 10 * iterations, preempted=False)
    return run


# ------------------------------------------------------------------------------------------ checkpoints are data
@pytest.mark.parametrize("env_id", ["CartPole-v1", "InvertedPendulum-v5"])
def test_env_state_as_data_continues_the_env_bit_for_bit(env_id):
    """Saved mid-episode, loaded with weights_only=True into a fresh env: 300 more steps, resets included, equal."""
    if env_id.endswith("-v5"):
        pytest.importorskip("mujoco")
    original = gym.make(env_id, max_episode_steps=10)  # short: most episodes end by TimeLimit
    original.reset(seed=5)
    actions = np.random.default_rng(0)
    act = (
        (lambda: int(actions.integers(2)))
        if env_id == "CartPole-v1"
        else (lambda: actions.uniform(-3, 3, size=1).astype(np.float32))
    )
    for _ in range(33):  # mid-episode
        if any(original.step(act())[2:4]):
            original.reset()
    buffer = io.BytesIO()
    torch.save([env_state.capture(original)], buffer)
    buffer.seek(0)
    states = torch.load(buffer, weights_only=True)  # no allow-list: tensors, numbers, strings, lists and dicts
    restored = gym.make(env_id, max_episode_steps=10)
    restored.reset(seed=99)
    assert env_state.restore(SimpleNamespace(is_main=True), [restored], states)
    resets = 0
    for _ in range(300):
        action = act()
        a, b = original.step(action), restored.step(action)
        assert np.array_equal(a[0], b[0]) and a[1:4] == b[1:4]
        if a[2] or a[3]:
            resets += 1
            assert np.array_equal(original.reset()[0], restored.reset()[0])
    assert resets > 0


def test_env_family_without_a_state_function_falls_back_once(capsys):
    """An env of no known family saves None; the resume says so once and starts new episodes (the script reseeds)."""
    env = gym.make("FrozenLake-v1")  # toy_text: no state function
    env.reset(seed=0)
    assert env_state.capture(env) is None
    assert not env_state.restore(SimpleNamespace(is_main=True), [env, env], [None, None])
    assert capsys.readouterr().out.count("no saved env state") == 1


def test_checkpoint_records_versions_and_names_damage_or_version_mismatch(tmp_path, clean_launch):
    run = train(tmp_path, iterations=1)
    ckpt = torch.load(os.path.join(run.run_dir, "checkpoint.pt"), weights_only=True)
    assert ckpt["versions"]["torch"] == torch.__version__ and ckpt["versions"]["gymnasium"] == gym.__version__
    assert set(ckpt["versions"]) == set(checkpoint.VERSIONED)
    torn = tmp_path / "torn.pt"
    torn.write_bytes((tmp_path / os.path.basename(run.run_dir) / "checkpoint.pt").read_bytes()[:-100])
    with pytest.raises(rt.RunError, match=r"is truncated or corrupt \(a damaged file"):
        checkpoint.read_checkpoint(str(torn))
    import zipfile

    foreign = tmp_path / "foreign.pt"  # an intact archive that this torch cannot read
    with zipfile.ZipFile(foreign, "w") as archive:
        archive.writestr("archive/data.pkl", b"not a pickle")
    with pytest.raises(rt.RunError, match=r"is intact but torch .* cannot read it .*version mismatch"):
        checkpoint.read_checkpoint(str(foreign))
    moved = tmp_path / "moved.pt"  # the old format, holding an object whose class has moved since it was written
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "oldlib_env.py").write_text("class Env:\n    pass\n")
    clean_launch.syspath_prepend(str(tmp_path / "lib"))
    torch.save(dict(script="ppo_multigpu", env=importlib.import_module("oldlib_env").Env()), moved)
    clean_launch.delitem(sys.modules, "oldlib_env")
    (tmp_path / "lib" / "oldlib_env.py").unlink()
    with pytest.raises(rt.RunError, match=r"holds pickled objects \(the format before checkpoints became data\)"):
        checkpoint.read_checkpoint(str(moved))


# ------------------------------------------------------------------------------------------ nothing runs from a file
class Payload:
    """Unpickling it calls open(marker, "w"): any code could run in its place (os.system in the issue)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def malicious_checkpoint(path, marker):
    path.parent.mkdir(parents=True, exist_ok=True)
    args = asdict(Args(runs_dir=str(path.parent.parent), run_name=path.parent.name))
    torch.save(dict(script="ppo_multigpu", args=args, rank_state=[Payload(marker)]), path)


@pytest.fixture
def main_in_process(clean_launch):
    """main_in_process(script, *flags): the RunError a script's main() raises, in this process (one rank)."""
    return lambda script, *flags: main_error(clean_launch, script, *flags)


def test_a_checkpoint_that_carries_code_is_refused_everywhere(tmp_path, main_in_process):
    """--resume (as a command), the automatic resume of a run directory, and evaluate: refused, the code never ran."""
    marker = tmp_path / "code-ran"
    path = tmp_path / "runs" / "shared" / "checkpoint.pt"
    malicious_checkpoint(path, marker)
    before = path.read_bytes()

    proc = launch("ppo_multigpu.py", ["--resume", path], nproc=0, timeout=120)
    refused = r"holds pickled objects \(the format before checkpoints became data\).* cannot be read safely"
    assert_one_line_error(proc, refused, "ppo_multigpu.py")
    message = main_in_process("ppo_multigpu", "--runs-dir", tmp_path / "runs", "--run-name", "shared")
    assert re.search(refused, message)
    with pytest.raises(evaluate.EvalError, match=refused):
        evaluate.main([str(path)])
    with pytest.raises(SystemExit):  # no opt-in left: the flag is gone
        evaluate.main([str(path), "--trust-checkpoint"])
    assert not marker.exists() and path.read_bytes() == before


@pytest.fixture
def evil_module(tmp_path, monkeypatch):
    """A module `evilmod` on the import path that writes a marker file when imported."""
    marker = tmp_path / "imported"
    (tmp_path / "evilmod").mkdir()
    (tmp_path / "evilmod" / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "evilmod"))
    monkeypatch.delitem(sys.modules, "evilmod", raising=False)
    return marker


def test_a_saved_module_env_id_is_refused_unless_given_here(tmp_path, main_in_process, evil_module):
    """A safe-format checkpoint whose env_id is `evilmod:CartPole-v1`: gym.make would import evilmod."""
    run = train(tmp_path / "runs", iterations=1)
    path = os.path.join(run.run_dir, "checkpoint.pt")
    ckpt = torch.load(path, weights_only=True)
    ckpt["args"]["env_id"] = "evilmod:CartPole-v1"
    ckpt |= dict(agent_kwargs=dict(obs_dim=4, n_actions=2), optimizer={}, agent={})
    torch.save(ckpt, path)
    message = main_in_process("ppo_multigpu", "--resume", run.run_dir)
    assert "'evilmod:CartPole-v1', whose module prefix would import" in message and "pass --env-id" in message
    name = os.path.basename(run.run_dir)
    message = main_in_process("ppo_multigpu", "--runs-dir", tmp_path / "runs", "--run-name", name)
    assert "belongs to a run with other flags" in message  # the automatic resume: not this command's flags
    with pytest.raises(evaluate.EvalError, match="whose module prefix would import"):
        evaluate.main([path])
    assert not evil_module.exists()


def test_evaluate_accepts_only_the_packages_own_scripts(tmp_path):
    """A `script` value is a module name of the package, never a path, even one to a file that exists."""
    (tmp_path / "elsewhere_multigpu.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    path = tmp_path / "checkpoint.pt"
    script = os.path.relpath(tmp_path / "elsewhere_multigpu", os.path.dirname(evaluate.__file__))
    torch.save(dict(script=script, args={}), path)
    with pytest.raises(evaluate.EvalError, match=r"'\.\./.*elsewhere_multigpu', which is not a script of this"):
        evaluate.main([str(path)])
    assert not (tmp_path / "imported").exists()
    assert {"ppo_multigpu", "dqn_atari_multigpu", "ppo_continuous_action_multigpu"} <= evaluate.package_scripts()


def test_track_and_wandb_names_never_come_from_a_checkpoint(tmp_path, clean_launch):
    run = train(tmp_path, iterations=1, track=False)
    path = os.path.join(run.run_dir, "checkpoint.pt")
    ckpt = torch.load(path, weights_only=True)
    ckpt["args"] |= dict(track=True, wandb_entity="someone-else")
    torch.save(ckpt, path)
    args, _ = rt.load_run(one_rank(runs_dir=str(tmp_path)), Args(resume=run.run_dir))
    assert not args.track and args.wandb_entity is None


# ------------------------------------------------------------------------------------------ one run, one directory
def test_same_second_and_same_slurm_job_never_share_a_directory(tmp_path, clean_launch):
    """Two learning rates launched in the same second, then within one SLURM job: two directories (srun steps),
    or, where the launch ids are equal (a batch script's own step), the second stops in one line."""
    clean_launch.setattr(launcher.time, "time", lambda: 1700000000.0)
    first, second = train(tmp_path / "a"), train(tmp_path / "a", learning_rate=1e-3)
    assert first.run_dir != second.run_dir

    clean_launch.setenv("SLURM_JOB_ID", "7")
    clean_launch.setenv("SLURM_STEP_ID", "0")
    first = train(tmp_path / "b")
    clean_launch.setenv("SLURM_STEP_ID", "1")
    second = train(tmp_path / "b", learning_rate=1e-3)
    assert first.run_dir != second.run_dir

    clean_launch.delenv("SLURM_STEP_ID")
    first = train(tmp_path / "c")
    before = open(os.path.join(first.run_dir, "checkpoint.pt"), "rb").read()
    with pytest.raises(rt.RunError, match=r"belongs to a run with other flags: --learning-rate 0.001 \(the run's: "):
        train(tmp_path / "c", learning_rate=1e-3)
    assert open(os.path.join(first.run_dir, "checkpoint.pt"), "rb").read() == before
    for run_dir in (first.run_dir, second.run_dir):
        assert len([f for f in os.listdir(run_dir) if f.startswith("events.out")]) == 1  # never resumed


def test_a_restart_with_the_same_flags_continues_its_own_run(tmp_path, clean_launch):
    """What an elastic restart or a requeue does: the same command finds its directory, before or after the
    first checkpoint, and continues it. Two launches that both found the name free: the second stops."""
    run = one_rank(runs_dir=str(tmp_path), run_name="job")
    rt.load_run(run, run.args)
    # crashed before its first checkpoint
    rt.open_run(run, rt.Sizes(world_size=1, num_envs=1, batch_size=10, num_iterations=100), None)
    rt.close_logs(1)
    again = one_rank(runs_dir=str(tmp_path), run_name="job")
    _, ckpt = rt.load_run(again, again.args)
    assert ckpt is None and again.run_dir == run.run_dir and not again.new_dir
    late = one_rank(runs_dir=str(tmp_path), run_name="job")
    late.run_dir, late.new_dir = run.run_dir, True  # found the name free just before the first run created it
    with pytest.raises(rt.RunError, match="another run created .*job meanwhile"):
        rt.open_run(late, rt.Sizes(world_size=1, num_envs=1, batch_size=10, num_iterations=100), None)


@pytest.mark.parametrize("name", ["", ".", "..", ".hidden"])
def test_run_name_must_be_a_plain_name(tmp_path, clean_launch, name):
    run = one_rank(runs_dir=str(tmp_path / "runs"), run_name=name)
    with pytest.raises(rt.RunError, match="--run-name must be a plain name"):
        rt.load_run(run, run.args)
    assert not (tmp_path / "runs").exists()


def test_a_finished_run_relaunched_stops_before_any_log(tmp_path, clean_launch):
    run = train(tmp_path, iterations=2, run_name="done")
    again = one_rank(runs_dir=str(tmp_path), run_name="done")
    _, ckpt = rt.load_run(again, again.args)
    files = sorted(os.listdir(run.run_dir))
    with pytest.raises(rt.RunError, match=r"has finished: its checkpoint is at global step 20, and --total-timesteps"):
        rt.open_run(again, rt.Sizes(world_size=1, num_envs=1, batch_size=10, num_iterations=2), ckpt)
    assert sorted(os.listdir(run.run_dir)) == files


# ------------------------------------------------------------------------------------------ Ctrl-C and exits
def test_second_ctrl_c_stops_at_once():
    run = one_rank()
    launcher.interrupt(run)
    assert run.signals == [signal.SIGINT]  # the first: a preemption vote, like SIGTERM
    with pytest.raises(KeyboardInterrupt):
        launcher.interrupt(run)


def test_an_error_exit_still_closes_the_writer_and_wandb(tmp_path, clean_launch):
    """A failure after the logs were opened: `exit_codes` closes TensorBoard (the scalar logged just before is in
    the events) and finishes the W&B run with the exit code (a forked child, since exit_codes leaves with os._exit)."""
    import wandb

    finished = tmp_path / "wandb-finish"
    clean_launch.setattr(wandb, "init", lambda **kw: SimpleNamespace(id="run-id"))
    clean_launch.setattr(wandb, "finish", lambda exit_code: finished.write_text(str(exit_code)))
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            with rt.exit_codes("demo"):
                run = one_rank(runs_dir=str(tmp_path), run_name="failing", track=True)
                rt.load_run(run, run.args)
                rt.open_run(run, rt.Sizes(world_size=1, num_envs=1, batch_size=10, num_iterations=100), None)
                rt.log(run, 10, {"losses/x": 0.5}, dict(episode_return_sum=0.0, episode_length_sum=0, episodes=0))
                raise RuntimeError("a bug")
        finally:
            os._exit(99)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1
    assert finished.read_text() == "1"  # the W&B run is closed, as failed
    assert read_scalars(tmp_path / "failing")["losses/x"] == [(10, 0.5)]


def test_ctrl_c_to_a_two_rank_run_checkpoints_exits_75_and_resumes(tmp_path, monkeypatch, capsys):
    """SIGINT to the process group of a 2-rank job (what Ctrl-C in its terminal does): both ranks stop after the
    same iteration with a checkpoint and exit 75; `--resume` (on one rank, here: helpers.main_output) finishes the
    run."""
    port, runs = free_port(), tmp_path / "runs"
    flags = ["--env-id", "CartPole-v1", "--local-num-envs", 2, "--num-steps", 16, "--num-minibatches", 2]
    flags += ["--update-epochs", 1, "--total-timesteps", 64 * 300, "--runs-dir", runs, "--checkpoint-every", 128]
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env |= dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        group = (lambda: os.setpgid(0, 0)) if rank == 0 else (lambda pgid=procs[0].pid: os.setpgid(0, pgid))
        cmd = [sys.executable, script_path("ppo_multigpu.py"), *map(str, flags)]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=REPO, text=True, preexec_fn=group, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        )  # fmt: skip
    try:
        wait_until(lambda: list(runs.glob("*/checkpoint.pt")), 120, procs[0], "first checkpoint")
        os.killpg(procs[0].pid, signal.SIGINT)
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    assert [p.returncode for p in procs] == [75, 75], outputs
    stderr = outputs[0][1]
    assert "interrupted: stopping with a checkpoint after this iteration" in stderr, stderr
    stopped = int(re.search(r"preempted by a signal at global step (\d+);", stderr).group(1))
    run_dir = only_run_dir(runs)
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["global_step"] == stopped < 64 * 300

    main_output(monkeypatch, capsys, "ppo_multigpu.py", "--resume", run_dir, "--total-timesteps", stopped + 64 * 2)
    final = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert final["global_step"] == stopped + 64 * 2 and json.loads((run_dir / FLAGS_FILE).read_text())
