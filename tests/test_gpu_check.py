"""benchmark/gpu_check/: on this machine (no CUDA) it says so in one line and exits 0; its real checks run end to
end with `--device cpu` at tiny sizes, one line each in OUT/summary.txt and on stdout; a failing check prints FAIL
and exits 1; killed partway, or a check at its time limit, it keeps the lines of the checks that finished and leaves
no process behind, not even one that ignores SIGTERM in a session of its own; every script of the package has its
rows in the script table."""

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

from benchmark.gpu_check import cli, correctness, plan, runner, sizes, speed
from benchmark.profile_offpolicy import PART_NAMES


def check(*args, timeout=900):
    cmd = [sys.executable, "-m", "benchmark.gpu_check", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(capsys):
    """In this process (the CPU run below starts `python -m benchmark.gpu_check` itself): one line and exit 0 without
    CUDA; a check that is not in the profile is exit 2 with one line."""
    assert cli.main([]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing checked"
    ]
    for only, error in (("everything", "not a check"), ("nccl-guard", "not a check of this profile (it is in --full)")):
        with pytest.raises(SystemExit) as exit:
            cli.main(["--only", only])
        assert exit.value.code == 2 and f"--only {only}: {error}" in capsys.readouterr().err


def test_every_script_has_its_rows_in_the_script_table():
    """A script added to cleanrl_ddp/ needs its rows (few iterations, graphs:, graphs-speed: on both devices), or
    its checks fail on the GPU; graphs: and graphs-speed: are listed for every script in --full."""
    names = {p.name for p in SCRIPTS.glob("*_multigpu.py")}
    tables = {"FEW_ITERATIONS": sizes.FEW_ITERATIONS}
    tables |= {
        f"{device}.{t}": getattr(getattr(sizes, device), t)
        for device in ("GPU", "CPU")
        for t in ("graphs", "graphs_speed")
    }
    for table, rows in tables.items():
        assert not names - set(rows), (
            f"add rows to {table} in benchmark/gpu_check/sizes.py for {sorted(names - set(rows))}"
        )
    full = {name for step in plan.full_profile() for name in step}
    assert {f"{kind}:{s}" for kind in ("graphs", "graphs-speed") for s in names} <= full


def test_the_checks_run_on_the_cpu_one_line_each(tmp_path):
    """The real checks, on the CPU: a few iterations of one script, the NCCL guard's one line, a SIGTERM-stopped
    2-rank run resumed on one rank to its exact step, whose checkpoint is then evaluated, the throughput with no speed
    flags next to the ceiling and the profiled split of an iteration; CleanRL's and LeanRL's PPO scripts are skipped,
    as nothing points at them. graphs: and graphs-speed:, one implementation for every script (on the CPU
    --cudagraphs runs the same functions eagerly): the Atari PPO's runs with and without --cudagraphs bitwise equal in
    every checkpoint entry, at world size 1 and trained on with and without it, at the default learning rate;
    SAC's speeds. SAC's env step timed part by part (benchmark/profile_offpolicy.py); LeanRL's SAC is
    skipped likewise. Then the comparison itself: one bit of one tensor, or one counter, changed in a checkpoint is a
    difference."""
    only = ["script:ppo_multigpu.py", "nccl-guard", "resume", "evaluate", "throughput"]
    only += [f"graphs:{sizes.ATARI}", *(f"{kind}:{sizes.SAC}" for kind in ("graphs-speed", "profile", "leanrl"))]
    proc = check("--device", "cpu", "--full", "--only", *only, "--out", tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    lines = [line for line in proc.stdout.splitlines() if re.match(r"(ok|FAIL|skip) ", line)]
    names = [re.match(r"\w+ +([^:]+):", line).group(1) for line in lines]
    expected = ["script", "graphs", "nccl-guard", "resume", "evaluate on cpu", "throughput 2 envs"]
    expected += ["profile 2 envs", "cleanrl 2 envs", "leanrl 2 envs", "async 2 envs", "graphs-speed", "profile"]
    assert names == [*expected, "leanrl"], output
    assert lines[0].startswith("ok    script:ppo_multigpu.py: world size 1 on cpu, global step 384, exit 0"), output
    graphs = r"ok    graphs:{}: --cudagraphs bitwise equal to --no-cudagraphs at world size 1 \(global step {}\), and "
    graphs += r"its checkpoint trained on to {} with and without it: every checkpoint entry but the flags "
    graphs += r"\((\d+) tensors at world size 1\) \["
    atari = re.match(graphs.format(sizes.ATARI, 32, 64), lines[1])
    assert atari and int(atari.group(1)) > 20, lines[1]  # the agent, Adam's state, the RNG states
    assert lines[2].startswith("ok    nccl-guard: exit 1 with one line: "), lines[2]
    assert "--backend nccl needs CUDA" in lines[2], lines[2]
    stopped = int(re.search(r"stopped at global step (\d+) of 192 ", lines[3]).group(1))
    assert 0 < stopped < 192 and "resumed on 1 rank to exactly 192" in lines[3], lines[3]
    assert re.match(r"ok    evaluate on cpu: return -?[\d.]+ ± [\d.]+ \(mean ± std over 2 sampled episodes", lines[4])
    throughput = r"ppo_atari_multigpu.py \(eager\) [\d,]+ SPS = \d+% of the env-only ceiling [\d,]+ of this call; "
    assert re.search(throughput + r"the update \d+% of the time", lines[5]), lines[5]
    split, per_step = lines[6].split("; ")
    parts = re.findall(r"(env step|policy step|host<->device copies|bookkeeping|update|other) \d+ ms", split)
    assert len(parts) == 6 and "one iteration of ppo_atari_multigpu.py alone (eager)" in split, lines[6]
    assert re.match(r"the policy step [\d.]+ ms per env step, the update \d+ ms per iteration \[", per_step), lines[6]
    assert lines[7].startswith("skip  cleanrl 2 envs: no --cleanrl-script")
    assert lines[8].startswith("skip  leanrl 2 envs: no --leanrl-script")
    asynchronous = r"ok    async 2 envs: ppo_atari_async_multigpu.py \(eager\) [\d,]+ SPS = \d+% of the synchronous "
    asynchronous += r"env-only ceiling [\d,]+ of this call \(goal: above it: (not )?met\)"
    assert re.match(asynchronous, lines[9]), lines[9]
    speeds = r"ok    graphs-speed:{}: {}, world size 1, steady SPS after the first {} logged points: [\d,]+ SPS "
    speeds += r"--no-cudagraphs \(eager, \d+ s\); [\d,]+ SPS --cudagraphs \(eager, \d+ s\) = [\d.]+x; "
    speeds += r"all at global step {} "
    assert re.match(speeds.format(sizes.SAC, "Pendulum-v1", 6, 80), lines[10]), lines[10]
    parts = re.findall(rf"({'|'.join(map(re.escape, PART_NAMES.values()))}) [\d.]+ ms \(", lines[11])
    assert parts == list(PART_NAMES.values()), lines[11]
    assert "one env step of sac_continuous_action_multigpu.py on Pendulum-v1" in lines[11], lines[11]
    assert lines[12].startswith(f"skip  leanrl:{sizes.SAC}: no --leanrl-sac-script")
    assert re.match(r"gpu_check: 10 ok, 0 FAIL, 3 skipped in [\d.]+ min", proc.stdout.splitlines()[-1]), output
    assert all(re.search(r" \[\d+ s\]$", line) for line in lines), lines  # each check's seconds
    assert (tmp_path / "logs" / "resume.log").read_text().startswith("$ ")
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("gpu_check --full on cpu: ") and summary[1:] == proc.stdout.splitlines()[1:], summary

    runs = tmp_path / "runs"
    eager, graphed = (runs / f"check-graphs-{sizes.ATARI[:-3]}-{run}" for run in ("eager", "graphs"))
    assert correctness.checkpoint_differences(eager, graphed) == ([], int(atari.group(1)))
    assert_every_entry_is_compared(graphed, tmp_path / "changed")


def test_graphs_runs_at_2_ranks_each_against_the_first_grad_syncs_eager_run():
    """graphs:'s runs for a row with 2-rank pairs (on a GPU the Atari PPO's: DDP and flat; SAC's: flat): --cudagraphs
    or --no-cudagraphs given on both sides, 2 processes through gloo with the replica check every iteration, and each
    --cudagraphs run compared with the first --grad-sync's --no-cudagraphs run (the CPU run above has none)."""
    row = sizes.GPU.graphs[sizes.ATARI]
    runs = correctness.graphs_runs(row)
    assert list(runs) == ["eager", "graphs", "eager-2-ddp", "graphs-2-ddp", "graphs-2-flat"]
    for run, (nproc, flags) in runs.items():
        assert flags[0] == ("--no-cudagraphs" if run.startswith("eager") else "--cudagraphs"), (run, flags)
        two_ranks = ["--grad-sync", run[-4:].lstrip("-"), "--total-timesteps", row.total2, "--backend", "gloo"]
        assert nproc == 1 or (nproc, flags[1:]) == (2, [*two_ranks, "--sync-check-every", 1]), (run, flags)
    pairs = [("eager", "graphs"), ("resumed-eager", "resumed-graphs"), ("eager-2-ddp", "graphs-2-ddp")]
    assert correctness.graphs_pairs(row) == [*pairs, ("eager-2-ddp", "graphs-2-flat")]
    assert correctness.graphs_pairs(sizes.GPU.graphs[sizes.SAC])[2:] == [("eager-2-flat", "graphs-2-flat")]
    assert list(correctness.graphs_runs(sizes.CPU.graphs[sizes.SAC])) == ["eager", "graphs"]


def assert_every_entry_is_compared(run_dir: Path, changed: Path) -> None:
    """graphs:'s comparison sees one bit of a weight or of an RNG stream, and any other entry, of the Atari PPO's
    checkpoint in `run_dir`; not its flags."""
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    weight = next(iter(ckpt["agent"]))
    changed.mkdir()
    for where in (f"['agent']['{weight}']", "['rng'][0]['torch']", "['iteration']"):
        copy = {**ckpt, "agent": dict(ckpt["agent"]), "rng": [dict(ckpt["rng"][0])]}
        if "agent" in where:  # the next float32 after one weight
            w = copy["agent"][weight] = ckpt["agent"][weight].clone(memory_format=torch.contiguous_format)
            w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(float("inf")))
        elif "rng" in where:  # one bit of torch's generator state
            copy["rng"][0]["torch"] = ckpt["rng"][0]["torch"].clone()
            copy["rng"][0]["torch"][-1] ^= 1
        else:
            copy["iteration"] += 1
        torch.save(copy, changed / "checkpoint.pt")
        differ, _ = correctness.checkpoint_differences(run_dir, changed)
        assert len(differ) == 1 and differ[0].startswith(where), (where, differ)
    torch.save({**ckpt, "args": {**ckpt["args"], "cudagraphs": False}}, changed / "checkpoint.pt")
    assert correctness.checkpoint_differences(run_dir, changed)[0] == []  # the flags are not compared


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
from benchmark.gpu_check import cli, runner
hung, ready = sys.argv[1:3]
def check_hung(c, name):
    c.run(name, [sys.executable, hung, ready, "launcher"])
    return runner.Result(name, "FAIL", "the hung processes ended on their own")
cli.CHECKS |= {kind: lambda c, script, kind=kind: check_hung(c, f"{kind}:{script}") for kind in ("gloo", "flat")}
sys.exit(cli.main(sys.argv[3:]))
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
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the suite's own (conftest.py): not here
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    hung_pids = ready_pids(ready, 4, proc)  # 2 launchers and their 2 ranks
    try:
        assert set(hung_pids) <= set(runner.marked(str(out.resolve()))), "not every hung process is marked"
        for pid in hung_pids:  # two checks at once: one thread per process (runner.step_env)
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
    budget = dataclasses.replace(sizes.CPU, timeouts={"script": 1})
    c = runner.Check("cpu", budget, tmp_path / "out", None)
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
    monkeypatch.delitem(sizes.FEW_ITERATIONS, "ppo_multigpu.py")
    monkeypatch.setenv("PYTHONPATH", "")  # main() sets it for the commands it runs: restored after the test
    assert cli.main(["--device", "cpu", "--only", "script:ppo_multigpu.py", "--out", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    no_row = "no row for it in FEW_ITERATIONS (benchmark/gpu_check/sizes.py): add its flags [0 s]"
    assert lines[1] == f"FAIL  script:ppo_multigpu.py: {no_row}", lines
    assert lines[2].startswith("gpu_check: 0 ok, 1 FAIL, 0 skipped")


def test_the_leanrl_row_is_skipped_without_its_script_or_envpool(tmp_path, monkeypatch, capsys):
    """The LeanRL row is one skip line without --leanrl-script, or without envpool (this machine's Python is too old
    for EnvPool 1.2.7); with both, a missing file is a FAIL line; `--leanrl-script` reaches the row."""
    import importlib.util

    monkeypatch.setenv("PYTHONPATH", "")  # Check() sets it for the commands it runs: restored after the test
    c = runner.Check("cpu", sizes.CPU, tmp_path / "c", None)
    skip = "skip  leanrl 8 envs: no --leanrl-script: LeanRL's script not run [0 s]"
    assert speed.check_leanrl_atari(c, 8, 2000.0).line() == skip
    envpool, find_spec = [None], importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: envpool[0] if m == "envpool" else find_spec(m, *a))
    c.leanrl_script = str(REPO / "benchmark" / "peers" / "leanrl_ppo_atari.py")
    line = speed.check_leanrl_atari(c, 8, 2000.0).line()
    assert line.startswith("skip  leanrl 8 envs: no envpool here (EnvPool 1.2.7 needs Python >= 3.12"), line
    envpool[0] = object()  # as if installed
    monkeypatch.setitem(cli.CHECKS, "nccl-1", lambda c: speed.check_leanrl_atari(c, 8, 2000.0))
    cli.main(["--device", "cpu", "--only", "nccl-1", "--out", str(tmp_path / "out"), "--leanrl-script", "no.py"])
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("FAIL  leanrl 8 envs: --leanrl-script ") and line.endswith("/no.py: no such file [0 s]")


def test_the_budget_skips_what_would_end_past_it(tmp_path, monkeypatch, capsys):
    """`--budget`: a check starts only if its estimate ends within the budget, else it is a skip line saying so, and
    the summary counts those skips."""
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setitem(plan.ESTIMATES, "nccl-1", 5)  # both in step 3 of the quick profile
    monkeypatch.setitem(plan.ESTIMATES, "resume", 100)
    argv = ["--device", "cpu", "--budget", "50", "--only", "nccl-1", "resume", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("skip  resume: not started: about 100 s would end past the budget of 50 s (0 s gone")
    assert lines[2] == "skip  nccl-1: NCCL needs CUDA [0 s]"
    assert lines[3].startswith("gpu_check: 0 ok, 0 FAIL, 2 skipped (1 for the budget of 50 s) in ")


def test_the_quick_profile_has_estimates_and_lists_only_known_checks():
    """The budget needs an estimate of every check of the quick profile; the profiles list only checks of CHECKS;
    the throughput runs right after the scripts, and by the estimates it and the correctness step fit the budget."""
    profiles = plan.quick_profile(), plan.full_profile()
    assert all(name.partition(":")[0] in cli.CHECKS for profile in profiles for step in profile for name in step)
    quick = plan.quick_profile()
    assert all(name.startswith("script:") for name in quick[0]) and quick[1] == ["throughput"], quick
    assert {f"graphs:{s}" for s in (sizes.ATARI, *sizes.OFF_POLICY)} <= set(quick[2]), quick
    assert quick[3:5] == [[f"graphs-speed:{sizes.ATARI}"], ["env-sweep:8"]], quick
    est = plan.ESTIMATES
    unknown = [name for step in quick for name in step if est.get(name, est.get(name.split(":")[0])) is None]
    assert not unknown, f"add their seconds to ESTIMATES: {unknown}"
    assert sum(max(map(plan.estimate, step)) for step in quick[:3]) <= plan.QUICK_BUDGET


def test_graphs_rows_of_a_script_without_the_flag_are_skip_lines(tmp_path, monkeypatch):
    """graphs: and graphs-speed: of a script whose Args has no cudagraphs field say so in a skip line."""
    monkeypatch.setenv("PYTHONPATH", "")
    c = runner.Check("cpu", sizes.CPU, tmp_path, None)
    assert sizes.has_flag(sizes.ATARI, "cudagraphs") and not sizes.has_flag(sizes.ATARI, "no_such_flag")
    for module, check, what in ((correctness, "check_graphs", "compare"), (speed, "check_graphs_speed", "time")):
        monkeypatch.setattr(module, "has_flag", lambda script, field: False)
        line = getattr(module, check)(c, sizes.ATARI).line()
        assert line.endswith(f": its Args has no cudagraphs field: no --cudagraphs path to {what} [0 s]"), line


def test_the_env_sweep_row_runs_on_the_cpu(tmp_path, monkeypatch):
    """`env-sweep:<envs>` runs `benchmark.throughput --env-sweep <envs>` (here 2 envs, 64 steps per setting) and
    reports its best settings in one line."""
    monkeypatch.setenv("PYTHONPATH", "")
    c = runner.Check("cpu", sizes.CPU, tmp_path, None)
    line = speed.check_env_sweep(c, "2").line()
    best = r"num_threads [12], batch_size [12]: [\d,]+ steps/s; all 2 at once: num_threads [12], [\d,]+ steps/s"
    own = r"[\d.]+x the scripts' num_threads [12] \([\d,]+\)"  # min(2 envs, the cores)
    assert re.fullmatch(rf"ok    env-sweep:2: {best} = {own} \[\d+ s\]", line), line
    assert len(re.findall(r"^env-sweep 2 envs: ", (tmp_path / "logs" / "env-sweep_2.log").read_text(), re.M)) == 4
