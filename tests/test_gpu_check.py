"""benchmark/gpu_check.py: on this machine (no CUDA) it says so in one line and exits 0; its real checks run end to
end with `--device cpu` at tiny sizes, one line each and a summary; a failing check prints FAIL and exits 1; every
script of the package has its few-iteration flags."""

import re
import subprocess
import sys

import pytest
import torch
from helpers import REPO, SCRIPTS

from benchmark import gpu_check


def check(*args, timeout=900):
    cmd = [sys.executable, "-m", "benchmark.gpu_check", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_it_says_so_in_one_line_and_exits_0():
    proc = check()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing checked"
    ]
    proc = check("--only", "everything")
    assert proc.returncode == 2 and "--only everything: not a check" in proc.stderr, proc.stderr


def test_every_script_has_its_few_iteration_flags():
    """A script added to cleanrl_ddp/ needs a row in FEW_ITERATIONS, or its check fails on the GPU."""
    missing = {p.name for p in SCRIPTS.glob("*_multigpu.py")} - set(gpu_check.FEW_ITERATIONS)
    assert not missing, f"add rows to FEW_ITERATIONS in benchmark/gpu_check.py for {sorted(missing)}"


def test_the_checks_run_on_the_cpu_one_line_each(tmp_path):
    """The real checks, on the CPU: a few iterations of one script, the NCCL guard's one line, a SIGTERM-stopped
    2-rank run resumed on one rank to its exact step, whose checkpoint is then evaluated, and the throughput next
    to the ceiling; CleanRL's script is skipped, as nothing points at it."""
    only = ["script:ppo_multigpu.py", "nccl-guard", "resume", "evaluate", "throughput"]
    proc = check("--device", "cpu", "--only", *only, "--out", tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    lines = [line for line in proc.stdout.splitlines() if re.match(r"(ok|FAIL|skip) ", line)]
    names = [re.match(r"\w+ +([^:]+):", line).group(1) for line in lines]
    assert names == ["script", "nccl-guard", "resume", "evaluate on cpu", "throughput 2 envs", "cleanrl 2 envs"], output
    assert lines[0].startswith("ok    script:ppo_multigpu.py: world size 1 on cpu, global step 384, exit 0"), output
    assert lines[1].startswith("ok    nccl-guard: exit 1 in ") and "--backend nccl needs CUDA" in lines[1], output
    stopped = int(re.search(r"stopped at global step (\d+) of 960 ", lines[2]).group(1))
    assert 0 < stopped < 960 and "resumed on 1 rank to exactly 960" in lines[2], lines[2]
    assert re.match(r"ok    evaluate on cpu: return -?[\d.]+ ± [\d.]+ \(mean ± std over 2 sampled episodes", lines[3])
    assert re.search(r"[\d,]+ SPS = \d+% of the env-only ceiling [\d,]+ of this call", lines[4]), lines[4]
    assert lines[5].startswith("skip  cleanrl 2 envs: no --cleanrl-script")
    assert re.match(r"gpu_check: 5 ok, 0 FAIL, 1 skipped in [\d.]+ min", proc.stdout.splitlines()[-1]), output
    assert (tmp_path / "logs" / "resume.log").read_text().startswith("$ ")


def test_a_failed_check_is_a_fail_line_and_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.delitem(gpu_check.FEW_ITERATIONS, "ppo_multigpu.py")
    monkeypatch.setenv("PYTHONPATH", "")  # main() sets it for the commands it runs: restored after the test
    assert gpu_check.main(["--device", "cpu", "--only", "script:ppo_multigpu.py", "--out", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[1]
        == "FAIL  script:ppo_multigpu.py: no row for it in FEW_ITERATIONS (benchmark/gpu_check.py): add its flags"
    )
    assert lines[2].startswith("gpu_check: 0 ok, 1 FAIL, 0 skipped")
