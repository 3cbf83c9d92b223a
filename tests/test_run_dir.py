"""Unit tests of the run directory and restarts, cleanrl_ddp/run_dir.py, through the run module's `rt.load_run` and
`rt.open_run` where a script would meet them: the directory's name, the flags a restart or `--resume` continues
with, another world size, the lease. In-process and fast; whole-script runs (tests/test_fault_tolerance.py,
tests/test_checkpoint_safety.py) check each behaviour once."""

import errno
import os
import socket
import subprocess
import sys
from dataclasses import asdict

import pytest
from helpers import REPO, Args, single_run

from cleanrl_ddp import checkpoint, launch, run_dir
from cleanrl_ddp import runtime as rt

SIZES = rt.Sizes(world_size=1, num_envs=1, batch_size=10, num_iterations=100)


def test_run_names_sort_by_start_time_and_a_restart_finds_its_own(monkeypatch, tmp_path):
    """`ls runs/` lists runs by start time, whatever their env; a restart of one launch (the same torchrun run id or
    SLURM job and step) continues in the directory its first attempt made, however much later it starts."""
    clock = [1700000000.0]
    monkeypatch.setattr(launch.time, "time", lambda: clock[0])
    started = []
    for env_id, run_id in [("Breakout", "b68db908-0c54-4be8-a5d5-05d8f3fed068"), ("ALE/Pong-v5", "slurm77.3")]:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        run = single_run(tmp_path, env_id=env_id)
        rt.load_run(run, run.args)
        rt.open_run(run, SIZES, None)
        started.append(os.path.basename(run.run_dir))
        clock[0] += 61
    assert started == [
        "20231114T221320Z__Breakout__test__1__b68db908",
        "20231114T221421Z__ALE-Pong-v5__test__1__slurm77.3",
    ]
    assert sorted(os.listdir(tmp_path)) == started  # by start time, not by env id
    clock[0] += 3600  # torchrun restarts the first launch's workers an hour later
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "b68db908-0c54-4be8-a5d5-05d8f3fed068")
    again = single_run(tmp_path, env_id="Breakout")
    rt.load_run(again, again.args)
    assert os.path.basename(again.run_dir) == started[0] and not again.new_dir


def test_per_rank_flags_keep_the_global_sizes():
    """Every `local_X` flag whose global `X` the checkpoint holds is X / world size (DQN has two)."""
    saved = dict(local_num_envs=4, local_batch_size=32, learning_rate=0.1)
    sizes = dict(world_size=2, num_envs=8, batch_size=64, num_iterations=10)
    assert run_dir.per_rank_flags(saved, sizes, 2) == dict(local_num_envs=4, local_batch_size=32)
    assert run_dir.per_rank_flags(saved, sizes, 1) == dict(local_num_envs=8, local_batch_size=64)
    assert run_dir.per_rank_flags(saved, sizes, 8) == dict(local_num_envs=1, local_batch_size=8)
    with pytest.raises(
        rt.RunError, match=r"num_envs 8 and batch_size 64 cannot be split evenly over 3 ranks; .*: 1, 2, 4, 8$"
    ):
        run_dir.per_rank_flags(saved, sizes, 3)
    ppo = dict(world_size=2, num_envs=6, local_batch_size=96, batch_size=192)  # a derived local size is no flag
    assert run_dir.per_rank_flags(dict(local_num_envs=3, num_steps=32), ppo, 3) == dict(local_num_envs=2)


def test_resume_at_another_world_size_derives_the_per_rank_flags_again(tmp_path, monkeypatch):
    """A checkpoint of 2 ranks x 4 envs resumes in one process with 8 envs; its own flag value (a restart
    replaying its command line) is read the same way; a value that changes the 8 envs is refused."""
    monkeypatch.setattr(sys, "argv", ["script"])
    args = asdict(Args(runs_dir=str(tmp_path), local_num_envs=4))
    ckpt = dict(script="ppo_multigpu", args=args, sizes=dict(num_envs=8, batch_size=64), world_size=2)
    ckpt |= dict(iteration=3, global_step=192, rng=[None, None], rank_state=[None, None])
    checkpoint.atomic_save(ckpt, str(tmp_path / "checkpoint.pt"))
    for argv, local_num_envs in ([], 8), (["--local-num-envs", "4"], 8), (["--local-num-envs", "8"], 8):
        monkeypatch.setattr(sys, "argv", ["script", *argv])
        resumed, _ = rt.load_run(single_run(tmp_path), Args(resume=str(tmp_path)))
        assert resumed.local_num_envs == local_num_envs, argv
    monkeypatch.setattr(sys, "argv", ["script", "--local-num-envs", "2"])
    with pytest.raises(
        rt.RunError, match=r"--local-num-envs 2 on 1 rank\(s\) changes the checkpoint's num_envs 8; omit"
    ):
        rt.load_run(single_run(tmp_path), Args(resume=str(tmp_path)))


def test_a_checkpoint_of_iteration_periods_loads_its_flags_as_global_steps(tmp_path, monkeypatch):
    """A checkpoint written when the PPO and PQN scripts counted --checkpoint-every and --sync-check-every in
    iterations (the old default 25) loads as it is: its flags are data, now read as global steps, and a value given
    with --resume wins (docs/runtime.md#checkpoints)."""
    args = asdict(Args(runs_dir=str(tmp_path))) | dict(checkpoint_every=25, sync_check_every=2)
    ckpt = dict(script="ppo_multigpu", args=args, sizes=dict(num_envs=1, batch_size=10), world_size=1)
    ckpt |= dict(iteration=3, global_step=30, rng=[None], rank_state=[None])
    checkpoint.atomic_save(ckpt, str(tmp_path / "checkpoint.pt"))
    monkeypatch.setattr(sys, "argv", ["script"])
    resumed, loaded = rt.load_run(single_run(tmp_path), Args(resume=str(tmp_path)))
    assert (resumed.checkpoint_every, resumed.sync_check_every, loaded["iteration"]) == (25, 2, 3)
    monkeypatch.setattr(sys, "argv", ["script", "--checkpoint-every", "50000"])
    resumed, _ = rt.load_run(single_run(tmp_path), Args(resume=str(tmp_path), checkpoint_every=50000))
    assert (resumed.checkpoint_every, resumed.sync_check_every) == (50000, 2)


def test_saved_flags_of_another_type_are_refused(tmp_path, monkeypatch):
    """A checkpoint's flags are data that someone else may have written: one of another type than its field's is
    refused in one line (before, the run went on and failed at its first use); an int passes as a float."""
    monkeypatch.setattr(sys, "argv", ["script"])
    args = asdict(Args(runs_dir=str(tmp_path)))
    ckpt = dict(script="ppo_multigpu", args=args, sizes=dict(num_envs=1, batch_size=10), world_size=1)
    ckpt |= dict(iteration=3, global_step=30, rng=[None], rank_state=[None])
    fit = [dict(dist_timeout=300), dict(eval_episodes=5), dict(backend="gloo"), dict(sync_check_every=7)]
    misfit = [dict(dist_timeout="300"), dict(seed=1.5), dict(cuda=1), dict(backend="mpi"), dict(total_timesteps=True)]
    for saved in fit + misfit:
        checkpoint.atomic_save(ckpt | dict(args=args | saved), str(tmp_path / "checkpoint.pt"))
        ((name, value),) = saved.items()
        if saved in fit:
            resumed, _ = rt.load_run(single_run(tmp_path), Args(resume=str(tmp_path)))
            assert getattr(resumed, name) == value
        else:
            with pytest.raises(rt.RunError, match=rf"holds flags of another type: {name} \({value!r}\); it was left"):
                rt.load_run(single_run(tmp_path), Args(resume=str(tmp_path)))


def test_the_lease_names_a_live_holder_and_passes_to_the_next_once_it_dies(tmp_path, monkeypatch, capsys):
    """cleanrl_ddp/lease.py: another live process's lease is refused in one line naming it; once that process is
    gone, this one takes the lease and names itself in the file; a file system without locks warns and goes on."""
    from cleanrl_ddp import lease

    monkeypatch.setattr(lease, "_held", {})
    holder_code = (
        "import sys; from cleanrl_ddp import lease; lease.take_or_refuse(sys.argv[1], 'L1'); print('held', flush=True)"
    )
    holder = subprocess.Popen([sys.executable, "-c", holder_code + "; sys.stdin.read()", tmp_path], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        message = lease.take_or_refuse(str(tmp_path), "L2")
        holder_text = f"host {socket.gethostname()}, pid {holder.pid}, launch L1"
        assert message.startswith(f"{tmp_path} is in use by a live run ({holder_text}): a second launch")
        assert message.endswith("(nothing was written)")
        run = single_run(tmp_path / "runs")  # a new run that found the name free, as the holder claimed it
        run.run_dir, run.new_dir = str(tmp_path), True
        with pytest.raises(rt.RunError, match=f"is in use by a live run \\(host .*, pid {holder.pid}, launch L1\\)"):
            rt.open_run(run, SIZES, None)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["lease"]  # no flags.json, no event file
    finally:
        holder.kill()
        holder.wait()
    assert lease.take_or_refuse(str(tmp_path), "L2") is None  # the dead holder's lock went with it
    assert (tmp_path / "lease").read_text() == f"host {socket.gethostname()}, pid {os.getpid()}, launch L2"
    assert lease.take_or_refuse(str(tmp_path), "L2") is None  # this process holds it already

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(lease.fcntl, "lockf", no_locks)
    (tmp_path / "no-locks").mkdir()
    assert lease.take_or_refuse(str(tmp_path / "no-locks"), "L3") is None
    assert "warning: no lease on" in capsys.readouterr().err
