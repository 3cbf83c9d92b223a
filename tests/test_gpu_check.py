"""benchmark/gpu_check.py: on this machine (no CUDA) it says so in one line and exits 0; its real checks run end to
end with `--device cpu` at tiny sizes, one line each in OUT/summary.txt and on stdout; a failing check prints FAIL
and exits 1; killed partway, or a check at its time limit, it keeps the lines of the checks that finished and leaves
no process behind, not even one that ignores SIGTERM in a session of its own; every script of the package has its
few-iteration flags."""

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, SCRIPTS

from benchmark import gpu_check
from benchmark.profile_offpolicy import PART_NAMES


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
    to the ceiling and the profiled split of an iteration; CleanRL's and LeanRL's PPO scripts are skipped, as
    nothing points at them; the Atari PPO's --cudagraphs against eager (on the CPU both eager: the check's runs,
    resumes and comparisons); SAC's env step timed part by part (benchmark/profile_offpolicy.py), its --cudagraphs
    runs (eager on the CPU) equal to eager at 1 and 2 ranks and their speed; LeanRL's SAC is skipped likewise."""
    only = ["script:ppo_multigpu.py", "nccl-guard", "resume", "evaluate", "throughput", "graphs:ppo_atari_multigpu.py"]
    only += [f"{kind}:{gpu_check.SAC}" for kind in ("profile", "graphs", "graphs-speed", "leanrl")]
    proc = check("--device", "cpu", "--full", "--only", *only, "--out", tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    lines = [line for line in proc.stdout.splitlines() if re.match(r"(ok|FAIL|skip) ", line)]
    names = [re.match(r"\w+ +([^:]+):", line).group(1) for line in lines]
    expected = ["script", "graphs", "nccl-guard", "resume", "evaluate on cpu", "throughput 2 envs", "profile 2 envs"]
    off_policy = ["profile", "graphs", "graphs-speed", "leanrl"]
    assert names == [*expected, "cleanrl 2 envs", "leanrl 2 envs", *off_policy], output
    assert lines[0].startswith("ok    script:ppo_multigpu.py: world size 1 on cpu, global step 384, exit 0"), output
    graphs = "graphs:ppo_atari_multigpu.py: --cudagraphs bitwise equal to eager at world size 1 (global step 32)"
    assert lines[1].startswith(f"ok    {graphs}"), lines[1]
    assert re.search(r"resumed from global step \d+ with and without it", lines[1]), lines[1]
    assert (
        lines[2].startswith("ok    nccl-guard: exit 1 with one line: ") and "--backend nccl needs CUDA" in lines[2]
    ), output
    stopped = int(re.search(r"stopped at global step (\d+) of 960 ", lines[3]).group(1))
    assert 0 < stopped < 960 and "resumed on 1 rank to exactly 960" in lines[3], lines[3]
    assert re.match(r"ok    evaluate on cpu: return -?[\d.]+ ± [\d.]+ \(mean ± std over 2 sampled episodes", lines[4])
    throughput = r"[\d,]+ SPS = \d+% of the env-only ceiling [\d,]+ of this call; the update \d+% of the time"
    assert re.search(throughput, lines[5]), lines[5]
    parts = re.findall(r"(env step|policy step|host<->device copies|bookkeeping|update|other) \d+ ms", lines[6])
    assert len(parts) == 6 and "one iteration of ppo_atari_multigpu.py alone" in lines[6], lines[6]
    assert lines[7].startswith("skip  cleanrl 2 envs: no --cleanrl-script")
    assert lines[8].startswith("skip  leanrl 2 envs: no --leanrl-script")
    parts = re.findall(rf"({'|'.join(map(re.escape, PART_NAMES.values()))}) [\d.]+ ms \(", lines[9])
    assert parts == list(PART_NAMES.values()), lines[9]
    assert "one env step of sac_continuous_action_multigpu.py on Pendulum-v1" in lines[9], lines[9]
    equal = (
        r"--cudagraphs equals eager after 16 updates at world size 1, 8 at 2 ranks sharing the device \(gloo, flat, "
    )
    equal += (
        r"replicas compared every iteration\): 1 rank\(s\): 98 tensors equal bitwise; 2 rank\(s\): 98 tensors equal"
    )
    assert re.search(equal, lines[10]), lines[10]
    speeds = r"Pendulum-v1, world size 1, steady SPS once updates run: [\d,]+ SPS eager \(\d+ s\), [\d,]+ SPS "
    assert re.search(speeds + r"--cudagraphs \(\d+ s\) = [\d.]+x; all at 80", lines[11]), lines[11]
    assert lines[12].startswith(f"skip  leanrl:{gpu_check.SAC}: no --leanrl-sac-script")
    assert re.match(r"gpu_check: 10 ok, 0 FAIL, 3 skipped in [\d.]+ min", proc.stdout.splitlines()[-1]), output
    assert all(re.search(r" \[\d+ s\]$", line) for line in lines), lines  # each check's seconds
    assert (tmp_path / "logs" / "resume.log").read_text().startswith("$ ")
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("gpu_check --full on cpu: ") and summary[1:] == proc.stdout.splitlines()[1:], summary


# A rank hung in a collective: it ignores SIGTERM, SIGHUP and SIGINT, outlives a closed output (SIGPIPE ignored),
# prints nothing and never ends. Started as `HUNG READY launcher`, it first starts one more of itself in a session of
# its own, as torchrun starts its ranks; each writes a file named for its pid into READY once its signals are ignored.
HUNG = """
import os, signal, subprocess, sys, time
for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGPIPE):
    signal.signal(s, signal.SIG_IGN)
if sys.argv[2:] == ["launcher"]:
    subprocess.Popen([sys.executable, sys.argv[0], sys.argv[1]], start_new_session=True)
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
while True:
    time.sleep(1)
"""
# gpu_check with its gloo: and flat: checks each running HUNG (a launcher and its rank) through its own Check.run
HUNG_CHECKS = """
import sys
from benchmark import gpu_check
hung, ready = sys.argv[1:3]
def check_hung(c, name):
    c.run(name, [sys.executable, hung, ready, "launcher"])
    return gpu_check.Result(name, "FAIL", "the hung processes ended on their own")
gpu_check.CHECKS |= {kind: lambda c, script, kind=kind: check_hung(c, f"{kind}:{script}") for kind in ("gloo", "flat")}
sys.exit(gpu_check.main(sys.argv[3:]))
"""


def start_hung(tmp_path) -> tuple[str, Path]:
    """HUNG's file and its empty READY folder."""
    hung, ready = tmp_path / "hung.py", tmp_path / "ready"
    hung.write_text(HUNG)
    ready.mkdir()
    return str(hung), ready


def ready_pids(ready: Path, count: int, proc=None) -> list[int]:
    """The pids of the first `count` HUNG processes, once they are ready (while `proc` runs, if given)."""
    deadline = time.monotonic() + 60
    while len(list(ready.iterdir())) < count:
        assert (proc is None or proc.poll() is None) and time.monotonic() < deadline, "the hung processes never started"
        time.sleep(0.05)
    return sorted(int(p.name) for p in ready.iterdir())


def kill_left(pids: list[int]) -> None:
    for pid in pids:
        if alive_process(pid):
            os.kill(pid, signal.SIGKILL)


def test_killed_it_keeps_the_finished_checks_and_leaves_no_process(tmp_path):
    """SIGTERM while two checks run, each a launcher and a rank in a session of its own that ignore SIGTERM, SIGHUP
    and a closed output and print nothing (ranks hung in a collective): the finished check's line stays in
    summary.txt, the running checks are named unfinished there, and gpu_check's own kill leaves none of them."""
    out = tmp_path / "out"
    hung, ready = start_hung(tmp_path)
    only = ["nccl-1", "gloo:ppo_atari_multigpu.py", "flat:ppo_atari_multigpu.py"]
    cmd = [sys.executable, "-c", HUNG_CHECKS, hung, str(ready), "--device", "cpu", "--out", str(out), "--only", *only]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    hung_pids = ready_pids(ready, 4, proc)  # 2 launchers and their 2 ranks
    try:
        assert set(hung_pids) <= set(gpu_check.marked(str(out.resolve()))), "not every hung process is marked"
        for pid in hung_pids:  # two checks at once: one thread per process (gpu_check.step_env)
            assert b"\0OMP_NUM_THREADS=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes(), pid
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
        assert (out / "logs" / "gloo_ppo_atari_multigpu.py.log").read_text().startswith("$ ")
        alive = [pid for pid in hung_pids if alive_process(pid)]
        assert not alive, f"left running: {alive}"
    finally:  # whatever failed, none of them outlives the test
        kill_left(hung_pids)


def test_a_check_past_its_limit_is_killed_with_every_process_it_started(tmp_path, monkeypatch):
    """A check's command still running at its time limit (a launcher and its rank, hung as above): it is killed with
    its rank, and the check fails saying so."""
    monkeypatch.setenv("PYTHONPATH", "")  # Check() sets it for the commands it runs: restored after the test
    budget = dataclasses.replace(gpu_check.CPU_BUDGET, timeouts={"script": 1})
    c = gpu_check.Check("cpu", budget, tmp_path / "out", None)
    hung, ready = start_hung(tmp_path)
    proc = c.start("script:hung.py", [sys.executable, hung, str(ready), "launcher"])
    hung_pids = ready_pids(ready, 2)
    try:
        code, out = c.finish("script:hung.py", proc)  # waits its 1 s limit from here
        assert code is None and out == "", (code, out)
        assert c.failed("script:hung.py", code, out).figure.startswith("killed at its limit of 1 s: ")
        alive = [pid for pid in hung_pids if alive_process(pid)]
        assert not alive, f"left running: {alive}"
    finally:
        kill_left(hung_pids)


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


def test_the_leanrl_row_is_skipped_without_its_script_or_envpool(tmp_path, monkeypatch, capsys):
    """The LeanRL row is one skip line without --leanrl-script, or without envpool (this machine's Python is too old
    for EnvPool 1.2.7); with both, a missing file is a FAIL line; `--leanrl-script` reaches the row."""
    import importlib.util

    monkeypatch.setenv("PYTHONPATH", "")  # Check() sets it for the commands it runs: restored after the test
    c = gpu_check.Check("cpu", gpu_check.CPU_BUDGET, tmp_path / "c", None)
    skip = "skip  leanrl 8 envs: no --leanrl-script: LeanRL's script not run [0 s]"
    assert gpu_check.check_leanrl_atari(c, 8, 2000.0).line() == skip
    envpool, find_spec = [None], importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: envpool[0] if m == "envpool" else find_spec(m, *a))
    c.leanrl_script = str(REPO / "benchmark" / "peers" / "leanrl_ppo_atari.py")
    line = gpu_check.check_leanrl_atari(c, 8, 2000.0).line()
    assert line.startswith("skip  leanrl 8 envs: no envpool here (EnvPool 1.2.7 needs Python >= 3.12"), line
    envpool[0] = object()  # as if installed
    monkeypatch.setitem(gpu_check.CHECKS, "nccl-1", lambda c: gpu_check.check_leanrl_atari(c, 8, 2000.0))
    gpu_check.main(["--device", "cpu", "--only", "nccl-1", "--out", str(tmp_path / "out"), "--leanrl-script", "no.py"])
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("FAIL  leanrl 8 envs: --leanrl-script ") and line.endswith("/no.py: no such file [0 s]")


def test_the_budget_skips_what_would_end_past_it(tmp_path, monkeypatch, capsys):
    """`--budget`: a check starts only if its estimate ends within the budget, else it is a skip line saying so, and
    the summary counts those skips."""
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setitem(gpu_check.ESTIMATES, "nccl-1", 5)  # both in step 2 of the quick profile
    monkeypatch.setitem(gpu_check.ESTIMATES, "resume", 100)
    argv = ["--device", "cpu", "--budget", "50", "--only", "nccl-1", "resume", "--out", str(tmp_path)]
    assert gpu_check.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("skip  resume: not started: about 100 s would end past the budget of 50 s (0 s gone")
    assert lines[2] == "skip  nccl-1: NCCL needs CUDA [0 s]"
    assert lines[3].startswith("gpu_check: 0 ok, 0 FAIL, 2 skipped (1 for the budget of 50 s) in ")


def test_the_quick_profile_has_estimates_and_lists_only_known_checks():
    """The budget needs an estimate of every check of the quick profile; the profiles list only checks of CHECKS,
    the speed rows where the budget put them."""
    profiles = gpu_check.quick_profile(), gpu_check.full_profile()
    assert all(name.partition(":")[0] in gpu_check.CHECKS for profile in profiles for step in profile for name in step)
    quick = gpu_check.quick_profile()
    assert quick[0][-1] == f"graphs:{gpu_check.ATARI}", quick[0]
    assert {f"graphs:{s}" for s in gpu_check.GRAPHS} <= {name for step in gpu_check.full_profile() for name in step}
    assert quick[2:5] == [["throughput"], [f"graphs-speed:{gpu_check.ATARI}"], ["env-sweep:8"]], quick
    est = gpu_check.ESTIMATES
    unknown = [name for step in quick for name in step if est.get(name, est.get(name.split(":")[0])) is None]
    assert not unknown, f"add their seconds to ESTIMATES: {unknown}"


def test_the_env_sweep_row_runs_on_the_cpu(tmp_path, monkeypatch):
    """`env-sweep:<envs>` runs `benchmark.throughput --env-sweep <envs>` (here 2 envs, 64 steps per setting) and
    reports its best settings in one line."""
    monkeypatch.setenv("PYTHONPATH", "")
    c = gpu_check.Check("cpu", gpu_check.CPU_BUDGET, tmp_path, None)
    line = gpu_check.check_env_sweep(c, "2").line()
    best = r"num_threads [12], batch_size [12]: [\d,]+ steps/s; all 2 at once: num_threads [12], [\d,]+ steps/s"
    own = r"[\d.]+x the scripts' num_threads [12] \([\d,]+\)"  # min(2 envs, the cores)
    assert re.fullmatch(rf"ok    env-sweep:2: {best} = {own} \[\d+ s\]", line), line
    assert len(re.findall(r"^env-sweep 2 envs: ", (tmp_path / "logs" / "env-sweep_2.log").read_text(), re.M)) == 4
