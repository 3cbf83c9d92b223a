"""benchmark/harness.py on tiny real runs: grid, skipping complete runs, SLURM array, CSV, plot, table."""

import csv
import gzip
import json

from helpers import script_path

from benchmark import harness

TINY = ["--", "--local-num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--total-timesteps", "512"]


def test_harness_runs_skips_and_reports(tmp_path, capsys):
    runs = tmp_path / "runs"
    grid = ["run", "--script", script_path("ppo_multigpu.py"), "--env-ids", "CartPole-v1", "--seeds", "1", "2"]
    grid += ["--world-sizes", "1", "2", "--runs-dir", str(runs), "--timeout", "180"]
    assert harness.main([*grid, *TINY]) == 0
    names = sorted(p.parent.name for p in runs.glob("*/harness.json"))
    assert names == [f"CartPole-v1__ppo_multigpu__ws{w}__seed{s}" for w in (1, 2) for s in (1, 2)]
    meta = json.loads((runs / names[-1] / "harness.json").read_text())
    assert "--nproc_per_node=2" in meta["command"] and "--seed 2" in meta["command"]

    capsys.readouterr()
    assert harness.main([*grid, *TINY]) == 0  # everything complete: nothing runs again
    assert "4 complete, 0 to run" in capsys.readouterr().out

    out = tmp_path / "report"
    assert harness.main(["report", "--runs-dir", str(runs), "--out", str(out)]) == 0
    with gzip.open(out / "scalars.csv.gz", "rt") as f:
        rows = list(csv.DictReader(f))
    returns = [r for r in rows if r["tag"] == "charts/episodic_return"]
    assert {(r["world_size"], r["seed"]) for r in returns} == {("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")}
    # both world sizes consume exactly the 512 global steps: 8 iterations of 64, or 4 of 128
    assert max(int(r["step"]) for r in returns if r["world_size"] == "2") == 512
    png = out / "ppo_multigpu__CartPole-v1.png"
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"
    table = (out / "results.md").read_text()
    assert "| ppo_multigpu | CartPole-v1 | 1 | 2 | 512 |" in table
    assert "| ppo_multigpu | CartPole-v1 | 2 | 2 | 512 |" in table
    commands = [line for line in table.splitlines() if "ppo_multigpu.py " in line]  # as a reader types them
    assert {c.split(" ", 1)[0] for c in commands} == {"python", "torchrun"} and len(commands) == 4


def test_harness_writes_a_slurm_array_instead_of_running(tmp_path):
    sbatch = tmp_path / "array.sbatch"
    args = ["run", "--script", "cleanrl_ddp/ppo_multigpu.py", "--env-ids", "CartPole-v1", "Acrobot-v1"]
    args += [
        "--seeds",
        "1",
        "2",
        "3",
        "--world-sizes",
        "2",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--slurm",
        str(sbatch),
    ]
    assert harness.main([*args, "--", "--total-timesteps", "1000"]) == 0
    text = sbatch.read_text()
    assert "#SBATCH --array=0-5" in text
    assert text.count("torchrun --standalone --nproc_per_node=2") == 6 and "--env-id Acrobot-v1 --seed 3" in text
    assert not (tmp_path / "runs" / "CartPole-v1__ppo_multigpu__ws2__seed1").exists()  # nothing ran
