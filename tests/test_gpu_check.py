"""benchmark/gpu_check.py: on this machine (no CUDA) it says so in one line and exits 0; its real checks run end to
end with `--device cpu` at tiny sizes, one line each in OUT/summary.txt and on stdout; a failing check prints FAIL
and exits 1; killed partway, it keeps the lines of the checks that finished and leaves no process behind; every
script of the package has its few-iteration flags."""

import re
import signal
import subprocess
import sys
import time

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
    proc = check("--only", "nccl-guard")
    assert proc.returncode == 2 and "--only nccl-guard: not a check of this profile (it is in --full)" in proc.stderr


def test_every_script_has_its_few_iteration_flags():
    """A script added to cleanrl_ddp/ needs a row in FEW_ITERATIONS, or its check fails on the GPU."""
    missing = {p.name for p in SCRIPTS.glob("*_multigpu.py")} - set(gpu_check.FEW_ITERATIONS)
    assert not missing, f"add rows to FEW_ITERATIONS in benchmark/gpu_check.py for {sorted(missing)}"


def test_the_checks_run_on_the_cpu_one_line_each(tmp_path):
    """The real checks, on the CPU: a few iterations of one script, the NCCL guard's one line, a SIGTERM-stopped
    2-rank run resumed on one rank to its exact step, whose checkpoint is then evaluated, the throughput next
    to the ceiling and the profiled split of an iteration; CleanRL's script is skipped, as nothing points at it; the
    Atari PPO's --cudagraphs against eager (on the CPU both eager: the check's runs, resumes and comparisons)."""
    only = ["script:ppo_multigpu.py", "nccl-guard", "resume", "evaluate", "throughput", "graphs:ppo_atari_multigpu.py"]
    proc = check("--device", "cpu", "--full", "--only", *only, "--out", tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    lines = [line for line in proc.stdout.splitlines() if re.match(r"(ok|FAIL|skip) ", line)]
    names = [re.match(r"\w+ +([^:]+):", line).group(1) for line in lines]
    expected = ["script", "nccl-guard", "resume", "evaluate on cpu", "throughput 2 envs", "profile 2 envs"]
    assert names == [*expected, "cleanrl 2 envs", "graphs"], output
    assert lines[0].startswith("ok    script:ppo_multigpu.py: world size 1 on cpu, global step 384, exit 0"), output
    assert (
        lines[1].startswith("ok    nccl-guard: exit 1 with one line: ") and "--backend nccl needs CUDA" in lines[1]
    ), output
    stopped = int(re.search(r"stopped at global step (\d+) of 960 ", lines[2]).group(1))
    assert 0 < stopped < 960 and "resumed on 1 rank to exactly 960" in lines[2], lines[2]
    assert re.match(r"ok    evaluate on cpu: return -?[\d.]+ ± [\d.]+ \(mean ± std over 2 sampled episodes", lines[3])
    throughput = r"[\d,]+ SPS = \d+% of the env-only ceiling [\d,]+ of this call; the update \d+% of the time"
    assert re.search(throughput, lines[4]), lines[4]
    parts = re.findall(r"(env step|policy step|host<->device copies|bookkeeping|update|other) \d+ ms", lines[5])
    assert len(parts) == 6 and "one iteration of ppo_atari_multigpu.py alone" in lines[5], lines[5]
    assert lines[6].startswith("skip  cleanrl 2 envs: no --cleanrl-script")
    graphs = "graphs:ppo_atari_multigpu.py: --cudagraphs bitwise equal to eager at world size 1 and 2 ranks (DDP, flat)"
    assert lines[7].startswith(f"ok    {graphs}") and re.search(
        r"resumed from global step \d+ with and without it", lines[7]
    )
    assert re.match(r"gpu_check: 7 ok, 0 FAIL, 1 skipped in [\d.]+ min", proc.stdout.splitlines()[-1]), output
    assert all(re.search(r" \[\d+ s\]$", line) for line in lines), lines  # each check's seconds
    assert (tmp_path / "logs" / "resume.log").read_text().startswith("$ ")
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("gpu_check --full on cpu: ") and summary[1:] == proc.stdout.splitlines()[1:], summary


def test_killed_it_keeps_the_finished_checks_and_leaves_no_process(tmp_path):
    """SIGTERM while two 2-rank checks run (torchrun starts its ranks in sessions of their own): the finished
    check's line stays in summary.txt, the running checks are named unfinished there, their logs hold what they
    printed so far, and no process that gpu_check started is left."""
    out = tmp_path / "out"
    only = ["nccl-1", "gloo:ppo_atari_multigpu.py", "flat:ppo_atari_multigpu.py"]
    cmd = [sys.executable, "-m", "benchmark.gpu_check", "--device", "cpu", "--out", str(out), "--only", *only]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = [out / "logs" / f"{kind}_ppo_atari_multigpu.py.log" for kind in ("gloo", "flat")]
    deadline = time.monotonic() + 300
    while not all(log.exists() and "ppo_atari_multigpu: 2 rank(s)" in log.read_text() for log in logs):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    started = gpu_check.marked(str(out.resolve()))
    assert len(started) >= 6, started  # 2 torchruns and their 4 ranks
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, output
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[1] == "skip  nccl-1: NCCL needs CUDA [0 s]", summary
    assert re.fullmatch(
        r"gpu_check: interrupted by SIGTERM after \d+ s; unfinished: flat:ppo_atari_multigpu.py, "
        r"gloo:ppo_atari_multigpu.py",
        summary[2],
    ), summary
    assert len(summary) == 3, summary
    alive = [pid for pid in started if alive_process(pid)]
    assert not alive, f"left running: {alive}"


def alive_process(pid: int) -> bool:
    """A process that exists and is not a zombie (one whose parent has not reaped it is dead all the same)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_failed_check_is_a_fail_line_and_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.delitem(gpu_check.FEW_ITERATIONS, "ppo_multigpu.py")
    monkeypatch.setenv("PYTHONPATH", "")  # main() sets it for the commands it runs: restored after the test
    assert gpu_check.main(["--device", "cpu", "--only", "script:ppo_multigpu.py", "--out", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[1]
        == "FAIL  script:ppo_multigpu.py: no row for it in FEW_ITERATIONS (benchmark/gpu_check.py): add its flags [0 s]"
    )
    assert lines[2].startswith("gpu_check: 0 ok, 1 FAIL, 0 skipped")
