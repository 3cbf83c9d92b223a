"""benchmark/harness.py on tiny real runs: grid, skipping complete runs, SLURM array, CSV, plot, table."""

import csv
import gzip
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, script_path

from benchmark import harness, versions

TINY = ["--", "--local-num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--total-timesteps", "512"]


def test_harness_runs_skips_and_reports(tmp_path, capsys):
    runs = tmp_path / "runs"
    grid = ["run", "--script", script_path("ppo_multigpu.py"), "--env-ids", "CartPole-v1", "--runs-dir", str(runs)]
    grid += ["--timeout", "180"]
    ws1 = [*grid, "--seeds", "1", "2", "--world-sizes", "1"]
    same_batch = [*grid, "--seeds", "1", "--world-sizes", "2", "--label", "ws2-same-batch"]  # 2 x 2 envs x 16 steps
    assert harness.main([*ws1, *TINY]) == 0 and harness.main([*same_batch, *TINY, "--num-steps", "16"]) == 0
    names = sorted(p.parent.name for p in runs.glob("*/harness.json"))
    assert names == [f"CartPole-v1__ppo_multigpu__{c}" for c in ("ws1__seed1", "ws1__seed2", "ws2-same-batch__seed1")]
    meta = json.loads((runs / names[-1] / "harness.json").read_text())
    assert "--nproc_per_node=2" in meta["command"] and "--num-steps 16" in meta["command"]
    assert meta["config"] == "ws2-same-batch"
    # the versions it ran with (this environment's: the command ran with this Python)
    assert meta["versions"]["torch"] == torch.__version__ and meta["versions"]["ale-py"] == metadata.version("ale-py")

    capsys.readouterr()
    assert harness.main([*ws1, *TINY]) == 0  # everything complete: nothing runs again
    assert "2 complete, 0 to run" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a label names one configuration, so one world size
        harness.main([*grid, "--world-sizes", "1", "2", "--label", "both", *TINY])

    out, published = tmp_path / "report", tmp_path / "published.csv"
    published.write_text(
        "# a comment line\nscript,env_id,label,mean,std,source\n"
        "ppo_multigpu,CartPole-v1,Paper X,1000000,1,its table 2\n"
    )
    report = ["report", "--runs-dir", str(runs), "--out", str(out), "--published", str(published)]
    assert harness.main([*report, "--tags", "charts/"]) == 0
    with gzip.open(out / "scalars.csv.gz", "rt") as f:
        rows = list(csv.DictReader(f))
    assert {r["tag"] for r in rows} >= {"charts/episodic_return", "charts/SPS"}
    assert all(r["tag"].startswith("charts/") for r in rows)  # --tags keeps the CSV compact
    returns = [r for r in rows if r["tag"] == "charts/episodic_return"]
    assert {(r["config"], r["seed"]) for r in returns} == {("ws1", "1"), ("ws1", "2"), ("ws2-same-batch", "1")}
    # both world sizes consume exactly the 512 global steps: 8 iterations of 64 at either world size
    assert max(int(r["step"]) for r in returns if r["world_size"] == "2") == 512
    png = out / "ppo_multigpu__CartPole-v1.png"
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"
    table = (out / "results.md").read_text()
    assert "| ppo_multigpu | CartPole-v1 | ws1 | 1 | 2 | 512 |" in table
    assert "| ppo_multigpu | CartPole-v1 | ws2-same-batch | 2 | 1 | 512 |" in table
    assert "| 1000000.0 ± 1.0 (Paper X; ours outside ± 2 std) |" in table
    assert "Published: Paper X: its table 2." in table
    assert f"\nPackages: torch {torch.__version__} (CUDA " in table and f"numpy {np.__version__}, " in table
    assert "Commands, one per run (3): [commands.txt](commands.txt)." in table
    commands = (out / "commands.txt").read_text().splitlines()  # as a reader types them
    assert {c.split(" ", 1)[0] for c in commands} == {"python", "torchrun"} and len(commands) == 3
    assert all("ppo_multigpu.py " in c for c in commands)


def test_final_return_is_the_mean_of_the_last_episodes():
    """CleanRL's final return (the last 100 episodes) from logged iteration means and their episode counts."""
    returns, counts = np.array([10.0, 20.0, 30.0]), np.array([50.0, 60.0, 70.0])
    assert harness.final_return(returns, counts) == (30 * 20 + 70 * 30) / 100  # the oldest iteration in part
    assert harness.final_return(returns, counts, episodes=1000) == (500 + 1200 + 2100) / 180  # fewer: all of them
    assert harness.final_return(np.arange(200.0), np.ones(200)) == np.arange(100.0, 200.0).mean()


def test_piece_rows_give_each_piece_of_each_run_in_pieces():
    """pieces.csv's rows: each piece's start, steps, commit, machine, versions and outcome, runs in name order; a
    piece under way to its last logged step; a run not made in pieces has none."""
    versions = dict(torch="2.13.0+cpu", cuda="none (CPU build)")
    piece = dict(start="2026-11-28T06:38:10Z", end="e", start_time=0.0, end_time=60.0, machine="vm", versions=versions)
    pieces = [piece | dict(piece=1, step_from=0, step_to=10, commit="aaa", outcome="stopped", exit_code=75)]
    pieces.append(
        piece | dict(piece=2, step_from=10, step_to=20, commit="bbb+changes", outcome="running", exit_code="-")
    )
    metas = [dict(name="b", pieces=pieces), dict(name="a", pieces=pieces[:1]), dict(name="grid run", pieces=[])]
    rows = harness.piece_rows(metas)
    assert [(r["run"], r["piece"], r["step from"], r["step to"], r["commit"]) for r in rows] == [
        ("a", 1, 0, 10, "aaa"),
        ("b", 1, 0, 10, "aaa"),
        ("b", 2, 10, 20, "bbb+changes"),
    ]
    assert rows[0] | dict(run="b") == rows[1] and (rows[0]["minutes"], rows[0]["machine"]) == ("1.0", "vm")
    assert rows[0]["versions"].startswith("torch 2.13.0+cpu") and rows[0]["start (UTC)"] == "2026-11-28T06:38:10Z"
    assert (rows[1]["outcome"], rows[1]["exit code"]) == ("stopped", 75)
    assert (rows[2]["outcome"], rows[2]["exit code"]) == ("running, to its last logged step", "")


def test_harness_writes_a_slurm_array_whose_tasks_finish_like_local_runs(tmp_path):
    """--slurm writes an array job instead of running; its task i runs the i-th run through the harness, so that
    a finished task leaves harness.json as a local run does (the report calls only such runs finished). Task 0 is
    run here as SLURM runs it: the script under bash with SLURM_ARRAY_TASK_ID set, from the repository root (the grid's
    first run, at world size 1: a 2-rank run goes through torchrun alike, test_harness_runs_skips_and_reports)."""
    sbatch, runs = tmp_path / "array.sbatch", tmp_path / "runs"
    args = ["run", "--script", "cleanrl_ddp/ppo_multigpu.py", "--env-ids", "CartPole-v1", "Acrobot-v1"]
    args += ["--seeds", "1", "2", "3", "--world-sizes", "1", "2", "--runs-dir", str(runs), "--slurm", str(sbatch)]
    tiny = ["--local-num-envs", "1", "--num-steps", "32", "--total-timesteps", "128"]
    assert harness.main([*args, "--", *tiny]) == 0
    text = sbatch.read_text()
    assert "#SBATCH --array=0-11" in text and "#SBATCH --gpus-per-task=2" in text  # room for the largest run
    assert text.count("python -m benchmark.harness run --script cleanrl_ddp/ppo_multigpu.py") == 12
    assert "--env-ids Acrobot-v1 --seeds 3 --world-sizes 2" in text
    first = runs / "CartPole-v1__ppo_multigpu__ws1__seed1"
    assert not first.exists()  # nothing ran
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python` is this one
    env = dict(os.environ, SLURM_ARRAY_TASK_ID="0", PATH=path)
    task = subprocess.run(["bash", str(sbatch)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert task.returncode == 0, task.stdout + task.stderr
    record = json.loads((first / harness.DONE_FILE).read_text())
    assert (record["env_id"], record["seed"], record["world_size"]) == ("CartPole-v1", 1, 1)
    assert "step 128/128" in (runs / f"{first.name}.log").read_text()
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == [first.name]  # task 0 ran run 0 only


def test_report_draws_a_peer_run_launched_by_hand_in_our_scripts_figure_not_finished(tmp_path):
    """A run of CleanRL's own script (benchmark/peers/), launched by hand, is known only by the hyperparameters table
    it logs: it joins the figure and table of the script it is measured against, with its world size, and is
    reported as not finished at its last step, against the published 10M-step return. Its events are written here
    with TensorBoard's writer in the shape CleanRL's script writes them (its rows, one return per episode)."""
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "runs" / "PongNoFrameskip-v4__cleanrl_ppo_atari_multigpu__1__1795757154"
    writer = SummaryWriter(run_dir)
    table = {"exp_name": "cleanrl_ppo_atari_multigpu", "seed": 1, "env_id": "PongNoFrameskip-v4"}
    table |= {"total_timesteps": 10000000, "batch_size": 1024, "num_iterations": 9765, "world_size": 2}
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in table.items()))
    for i, step in enumerate(range(1024, 40961, 1024)):
        writer.add_scalar("charts/episodic_return", -21.0 + i / 10, step)
        writer.add_scalar("charts/SPS", 50, step)
    writer.close()
    out = tmp_path / "report"
    assert harness.main(["report", "--runs-dir", str(tmp_path / "runs"), "--out", str(out)]) == 0
    text = (out / "results.md").read_text()
    row = "| ppo_atari_multigpu | PongNoFrameskip-v4 | cleanrl_ppo_atari_multigpu-ws2 | 2 | 1 | 40960 |"
    assert row in text and "| not finished: at step 40,960 of 10,000,000 |" in text
    assert "20.3 ± 0.4 (CleanRL at 10,000,000 steps; not finished)" in text
    assert f"Launched by hand (no command, machine or versions recorded): {run_dir.name}." in text
    assert (out / "ppo_atari_multigpu__PongNoFrameskip-v4.png").is_file()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["run", "--script", "nope.py", "--env-ids", "CartPole-v1"], "--script nope.py: no such file"),
        (["run", "--script", "{ppo}", "--env-ids", "CartPole-v1", "--world-sizes", "0"], "--world-sizes and --jobs"),
        (["report", "--runs-dir", "{tmp}/nope", "--out", "{tmp}/out"], "--runs-dir {tmp}/nope: no such directory"),
    ],
    ids=["no-script", "world-size-0", "no-runs-dir"],
)
def test_bad_flags_are_one_line(tmp_path, capsys, flags, message):
    names = dict(ppo=script_path("ppo_multigpu.py"), tmp=tmp_path)
    with pytest.raises(SystemExit) as leave:
        harness.main([f.format(**names) for f in flags])
    assert leave.value.code == 2 and f"error: {message.format(**names)}" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_versions_read_torchs_cuda_build_without_importing_torch(tmp_path, monkeypatch):
    """Recording versions imports no torch (~200 MB in a process that waits on runs): its CUDA build is read as text."""
    code = "import json, sys; from benchmark import versions; print(json.dumps([versions.package_versions()['cuda'], "
    code += "'torch' in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [torch.version.cuda or "none (CPU build)", False]

    class Dist:  # a CUDA build's torch/version.py, as torch 2.x writes it
        def locate_file(self, name):
            return tmp_path / name

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch/version.py").write_text(
        "__version__ = '2.4.0+cu121'\ndebug = False\ncuda: Optional[str] = '12.1'\n"
    )
    monkeypatch.setattr(versions.metadata, "distribution", lambda name: Dist())
    assert versions.torch_cuda_build() == "12.1"
    (tmp_path / "torch/version.py").write_text("cuda: Optional[str] = None\nhip: Optional[str] = '6.2.41133'\n")
    assert versions.torch_cuda_build() == "none (ROCm 6.2.41133)"
    (tmp_path / "torch/version.py").write_text("cudnn = 1\n")
    assert versions.torch_cuda_build() == "?"
