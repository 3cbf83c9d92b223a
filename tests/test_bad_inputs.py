"""Bad input is one line and a non-zero exit, never a traceback. Each case runs in this
process and stops with the RunError (or evaluate's EvalError) that `rt.exit_codes` prints as one line with exit
code 2 (tests/test_runtime.py checks that path); nothing is written before it. One case also runs as a command."""

import dataclasses
import errno
import importlib
import math
import os
import re
import resource
import subprocess
import sys
import threading
from typing import Optional

import pytest
import torch
from helpers import REPO, as_one_rank, assert_one_line_error, launch, main_error, main_exit, script_path

from cleanrl_ddp import errors, evaluate
from cleanrl_ddp import runtime as rt

# a run of 32 steps: without its check, a bad flag would train (or crash) in seconds, not for the default budget
DQN_TINY = ("--total-timesteps", 32, "--local-num-envs", 1, "--buffer-size", 32, "--learning-starts", 16)
DQN_TINY += ("--train-frequency", 4, "--local-batch-size", 4, "--log-every", 8)
PPO_TINY = ("--total-timesteps", 32, "--local-num-envs", 1, "--num-steps", 16, "--num-minibatches", 1)


@pytest.fixture
def main_in_process(monkeypatch, tmp_path):
    """main_in_process(script, *flags): the RunError a script's main() raises, in this process (one rank)."""

    def run(script: str, *flags) -> str:
        message = main_error(monkeypatch, script, "--runs-dir", tmp_path / "runs", *flags)
        assert not (tmp_path / "runs").exists()  # stopped before writing anything
        return message

    return run


@pytest.mark.parametrize(
    "script, flags, message",
    [
        (
            "ppo_multigpu",
            ("--env-id", "FrozenLake-v1", *PPO_TINY),
            "--env-id FrozenLake-v1 has a Discrete observation space",
        ),
        (
            "ppo_multigpu",
            ("--env-id", "Blackjack-v1", *PPO_TINY),
            "--env-id Blackjack-v1 has a Tuple observation space",
        ),
        ("dqn_atari_multigpu", ("--exploration-fraction", 0, *DQN_TINY), "--exploration-fraction must be positive"),
        ("dqn_atari_multigpu", ("--repeat-action-probability", 2, *DQN_TINY), "--repeat-action-probability must be"),
        (
            "ppo_multigpu",
            ("--dist-timeout", "inf", *PPO_TINY),
            "--dist-timeout must be positive (seconds) and at most 31536000",
        ),
        ("ppo_multigpu", ("--run-name", "..", *PPO_TINY), "--run-name must be a plain name"),
        ("pqn_multigpu", ("--env-id", "Pendulum-v1", *PPO_TINY), "--env-id Pendulum-v1 has a Box action space"),
        ("pqn_multigpu", ("--env-id", "NoSuchEnv-v9", *PPO_TINY), "unknown --env-id 'NoSuchEnv-v9'"),
        ("pqn_multigpu", ("--exploration-fraction", 0, *PPO_TINY), "--exploration-fraction must be positive"),
        ("pqn_multigpu", ("--num-minibatches", 5, *PPO_TINY[:-2]), "does not divide into --num-minibatches"),
        ("pqn_atari_multigpu", ("--env-id", "CartPole-v1", *PPO_TINY), "unknown --env-id 'CartPole-v1': not an ALE"),
        ("pqn_atari_multigpu", ("--repeat-action-probability", 2, *PPO_TINY), "--repeat-action-probability must"),
    ],
    ids=[
        "frozenlake",
        "blackjack",
        "exploration-fraction-0",
        "repeat-action-probability-2",
        "dist-timeout-inf",
        "run-name-dotdot",
        "pqn-continuous-actions",
        "pqn-unknown-env",
        "pqn-exploration-fraction-0",
        "pqn-indivisible",
        "pqn-atari-not-a-game",
        "pqn-atari-repeat-action-probability-2",
    ],
)
def test_bad_flag_is_one_line(main_in_process, script, flags, message):
    assert message in main_in_process(script, *flags)


def test_float_flags_out_of_range_are_refused():
    """Every script's float flags (run.FLAG_RANGES; any return goes, --dist-timeout: test_runtime.py): the
    defaults and each range's edges pass; past an edge, or NaN, is one RunError naming the flag; so is a --seed
    numpy refuses."""
    from cleanrl_ddp import run

    past = {"in [0, 1]": (1.5, -0.1), "finite and at least 0": (math.inf, -1e-9), "positive": (0.0, -1.0)}
    past |= {"at least 0 (inf: no limit)": (-1.0,), "a number": ()}
    edges = {"in [0, 1]": (0.0, 1.0), "finite and at least 0": (0.0,), "at least 0 (inf: no limit)": (0.0, math.inf)}
    flags = set()
    for name in [p.stem for p in (REPO / "cleanrl_ddp").glob("*_multigpu.py")]:
        args = importlib.import_module(f"cleanrl_ddp.{name}").Args()
        run.check_values(args)
        floats = [f.name for f in dataclasses.fields(args) if f.type in (float, Optional[float], "float")]
        flags |= set(floats)
        for flag in floats:
            must = run.FLAG_RANGES.get(flag, "a number")
            for value in edges.get(must, ()):
                run.check_values(dataclasses.replace(args, **{flag: value}))
            for value in (*past[must], math.nan):
                with pytest.raises(rt.RunError, match=f"--{flag.replace('_', '-')} must be {re.escape(must)}, got"):
                    run.check_values(dataclasses.replace(args, **{flag: value}))
        for seed in (-1, 2**32):
            with pytest.raises(rt.RunError, match=r"--seed must be in \[0, 2\*\*32 - 1\], got"):
                run.check_values(dataclasses.replace(args, seed=seed))
    # each float flag has its range decided, and the table no name that no script has
    assert flags - set(run.FLAG_RANGES) == {"target_return", "dist_timeout"} and set(run.FLAG_RANGES) <= flags


def test_sizes_beyond_memory_are_one_line(monkeypatch, capsys, tmp_path):
    """A rollout of 10^13 steps (160 TB: more than any address space, whatever the kernel's overcommit) fails as
    the script allocates it: one line, exit 2 (the sizes are the input at fault), no run directory."""
    flags = ("--num-steps", 10**13, "--num-minibatches", 1, "--local-num-envs", 1, "--total-timesteps", 10**13)
    code, stderr = main_exit(monkeypatch, capsys, "ppo_multigpu.py", *flags, "--runs-dir", tmp_path / "runs")
    line = r"ppo_multigpu: error: ran out of memory \(DefaultCPUAllocator: can't allocate memory: .* bytes.*"
    assert code == 2 and re.fullmatch(line + "; nothing was overwritten", stderr.strip()), stderr
    assert not list((tmp_path / "runs").glob("*"))


def test_a_full_disk_while_logging_is_one_line(tmp_path, monkeypatch):
    """TensorBoard's writer thread finds no room (a file-size limit, from the logs' opening on, below the event file's
    first records, as a full disk): its error reaches the loop's next log and is one line, exit 2, without the thread's
    traceback. In a forked child: the limit and exit_codes' os._exit stay there."""
    read, write = os.pipe()  # stderr: a pipe, which the file-size limit does not cover
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.dup2(write, 2)
            sys.stderr = open(2, "w", closefd=False)
            threading.excepthook = threading.__excepthook__  # Python's, which pytest replaces with its own
            open_logs = rt.open_logs
            room = (resource.RLIMIT_FSIZE, (200, 200))  # the event file's header, not the hyperparameters' text
            monkeypatch.setattr(rt, "open_logs", lambda *a: resource.setrlimit(*room) or open_logs(*a))
            flags = ("--runs-dir", tmp_path / "runs", *PPO_TINY[:-6], "--num-steps", 32, "--total-timesteps", 512)
            with as_one_rank(monkeypatch, "ppo_multigpu.py", *flags) as main, rt.exit_codes("ppo_multigpu"):
                main()
        finally:
            os._exit(99)  # never reached when exit_codes leaves as it should; never back into pytest
    os.close(write)
    with os.fdopen(read) as stderr:
        lines = stderr.read().strip().splitlines()
    _, status = os.waitpid(pid, 0)
    line = "ppo_multigpu: error: no room to write (OSError: [Errno 27] File too large); the last checkpoint, if any, is"
    assert os.waitstatus_to_exitcode(status) == 2 and len(lines) == 1 and lines[0].startswith(line), lines


def test_a_full_disk_in_another_thread_is_not_hidden(capsys):
    """The hook that keeps TensorBoard's writer thread quiet on a full disk prints any other thread's error."""

    def no_room():
        raise OSError(errno.ENOSPC, "No space left on device")

    threading.excepthook, hook = errors.quiet_writer_disk_full, threading.excepthook
    try:
        thread = threading.Thread(target=no_room)
        thread.start()
        thread.join()
    finally:
        threading.excepthook = hook
    assert "OSError: [Errno 28] No space left on device" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--device", "bogus"), "--device 'bogus' is not a torch device"),
        pytest.param(
            ("--device", "cuda"),
            "--device cuda: CUDA is not available here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
        ),
        (("--seed", "-1"), "--seed must be at least 0, got -1"),
        (("--episodes", "0"), "--episodes must be at least 1, got 0"),
    ],
)
def test_evaluate_bad_flag_is_one_line(tmp_path, flags, message):
    with pytest.raises(evaluate.EvalError, match=message.replace("(", r"\(")):
        evaluate.main([str(tmp_path), *flags])  # refused before the (missing) checkpoint is read


def test_evaluate_device_index_beyond_the_machine_is_one_line(tmp_path, monkeypatch):
    """`--device cuda:7` on a one-GPU machine (CUDA stood in for: this test runs on CPU machines too); cuda:0 passes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(evaluate.EvalError, match=r"--device cuda:7: this machine has 1 GPU\(s\), cuda:0 to cuda:0"):
        evaluate.main([str(tmp_path), "--device", "cuda:7"])
    assert evaluate.choose_device("cuda:0") == torch.device("cuda:0")


def test_dist_timeout_inf_with_two_ranks_is_one_line_as_a_command(tmp_path):
    """The whole path once: torchrun, 2 ranks, one line from rank 0, nothing written."""
    flags = ["--dist-timeout", "inf", "--runs-dir", tmp_path / "runs", "--total-timesteps", 512]
    proc = launch("ppo_multigpu.py", flags, nproc=2, timeout=120)
    assert_one_line_error(
        proc, r"--dist-timeout must be positive \(seconds\) and at most 31536000, got inf", "ppo_multigpu.py"
    )
    assert not (tmp_path / "runs").exists()


def test_unwritable_run_directory_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # even root cannot create a directory under a regular file
    proc = launch("ppo_multigpu.py", ["--runs-dir", blocker / "runs", *PPO_TINY], nproc=2, timeout=120)
    pattern = r"cannot write to the run directory .*a-file/runs/.*: Not a directory"
    assert_one_line_error(proc, pattern, "ppo_multigpu.py")
    assert blocker.read_text() == "not a directory"


def test_help_into_a_closed_pipe_exits_141_without_a_traceback():
    """`script --help | head`: the reader leaves before the help is written; the script stops as a shell tool does."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, script_path("ppo_multigpu.py"), "--help"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, "")
