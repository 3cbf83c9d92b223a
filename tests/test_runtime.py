"""Unit tests of the run module, cleanrl_ddp/runtime.py, and of the modules beside it (run.py, launch.py,
checkpoint.py, env_state.py; run_dir.py: tests/test_run_dir.py): in-process and fast (no torchrun), except the
exit-code tests, which need a process of their own. Whole-script runs elsewhere check each behaviour once."""

import ast
import importlib
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import REPO, Args, main_output, read_scalars, single_run, wait_until

from cleanrl_ddp import checkpoint, env_state, launch
from cleanrl_ddp import runtime as rt

SCRIPTS = [
    "ppo_multigpu",
    "ppo_atari_multigpu",
    "ppo_atari_async_multigpu",
    "ppo_continuous_action_multigpu",
    "dqn_atari_multigpu",
]


@pytest.fixture
def launch_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    for var in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    for var in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID"):
        monkeypatch.delenv(var, raising=False)
    for var in ("SLURM_LOCALID", "SLURM_CPU_BIND_TYPE", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_every_script_goes_through_the_module():
    """Each script imports the run module and keeps no copy of its plumbing; every `rt.X` is defined in runtime.py
    (or named there from run.py: `RunArgs`, `Run`)."""
    runtime = ast.parse((REPO / "cleanrl_ddp" / "runtime.py").read_text()).body
    runtime_names = {n.name for n in runtime if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    runtime_names |= {t.id for n in runtime if isinstance(n, ast.Assign) for t in n.targets}
    from_run = [n for n in runtime if isinstance(n, ast.ImportFrom) and n.module == "cleanrl_ddp.run"]
    runtime_names |= {a.name for n in from_run for a in n.names}
    plumbing = {"atomic_save", "load_checkpoint", "read_launch_env", "launch_id", "check_elastic_restarts"}
    plumbing |= {"rng_states", "set_rng_states", "state_checksum", "check_replicas_in_sync", "lost_rank_message"}
    plumbing |= {"log_video", "steps_crossed", "RunError", "name_run_dir", "take_saved_flags", "claim_run_dir"}
    for script in SCRIPTS:
        tree = ast.parse((REPO / "cleanrl_ddp" / f"{script}.py").read_text())
        imports = [a.asname for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
        assert "rt" in imports, f"{script} does not import cleanrl_ddp.runtime as rt"
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert not defined & plumbing, f"{script} defines run plumbing again: {sorted(defined & plumbing)}"
        args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
        assert [b.attr for b in args.bases] == ["RunArgs"], script
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert {"eval_action", "load_agent", "derive_sizes", "main"} <= names, script
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "rt"}
        assert used <= runtime_names, f"{script}: rt.{sorted(used - runtime_names)} not defined in runtime.py itself"


def package_imports(path: Path) -> set:
    """The cleanrl_ddp modules that `path` imports when it runs (annotation-only `if TYPE_CHECKING:` blocks aside)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "cleanrl_ddp":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cleanrl_ddp."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("cleanrl_ddp.")}
    return found


def test_no_import_cycle_and_every_module_imports_on_its_own():
    """The modules of cleanrl_ddp/ import each other without a cycle (runtime imports run_dir, launch, checkpoint and
    run; below them only errors), and each one imports cleanly first, with none of them loaded."""
    modules = sorted(p.stem for p in (REPO / "cleanrl_ddp").glob("*.py") if p.stem != "__init__")
    graph = {m: package_imports(REPO / "cleanrl_ddp" / f"{m}.py") & set(modules) for m in modules}
    assert graph["errors"] == set(), "errors.py must import nothing of ours"
    done, visiting = set(), []

    def visit(m):
        assert m not in visiting, f"import cycle: {' -> '.join(visiting[visiting.index(m) :] + [m])}"
        if m not in done:
            visiting.append(m)
            for dependency in sorted(graph[m]):
                visit(dependency)
            visiting.pop()
            done.add(m)

    for m in modules:
        visit(m)
    ours = lambda: [n for n in sys.modules if n == "cleanrl_ddp" or n.startswith("cleanrl_ddp.")]  # noqa: E731
    saved = {name: sys.modules[name] for name in ours()}
    try:
        for order in (modules, modules[::-1]):
            for m in order:  # each module first, with no module of the package loaded
                for name in ours():
                    del sys.modules[name]
                importlib.import_module(f"cleanrl_ddp.{m}")
    finally:  # the modules every other test imported, as they were
        for name in ours():
            del sys.modules[name]
        sys.modules.update(saved)


def test_read_launch_env_torchrun_slurm_and_plain(launch_env):
    assert launch.read_launch_env() == (0, 0, 1, 1)
    launch_env.setenv("SLURM_NTASKS", "16")
    launch_env.setenv("SLURM_PROCID", "9")
    launch_env.setenv("SLURM_LOCALID", "1")
    launch_env.setenv("SLURM_NTASKS_PER_NODE", "8(x2)")
    with pytest.raises(rt.RunError, match="under srun, export MASTER_ADDR"):
        launch.read_launch_env()
    launch_env.setenv("MASTER_ADDR", "127.0.0.1")
    launch_env.setenv("MASTER_PORT", "29500")
    assert launch.read_launch_env() == (9, 1, 16, 8)  # the GLOBAL rank, not the node-local one
    for var, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2").items():
        launch_env.setenv(var, value)
    assert launch.read_launch_env() == (3, 1, 4, 2)  # torchrun's variables win
    launch_env.delenv("MASTER_PORT")  # an env:// launch made by hand: one line, not init_process_group's traceback
    with pytest.raises(rt.RunError, match="with WORLD_SIZE=4, export MASTER_PORT"):
        launch.read_launch_env()
    launch_env.setenv("WORLD_SIZE", "1")
    assert launch.read_launch_env() == (3, 1, 1, 2)  # one process joins no group: no address needed


@pytest.mark.parametrize(
    "layout, node_id, tasks",
    [("2", "0", 2), ("2(x3),1", "2", 2), ("2(x3),1", "3", 1), ("1,3", "1", 3)],
)
def test_srun_without_ntasks_per_node_reads_the_steps_layout(launch_env, layout, node_id, tasks):
    """Plain `srun --ntasks=N` sets SLURM_STEP_TASKS_PER_NODE, not SLURM_NTASKS_PER_NODE (seen on SLURM 22.05)."""
    for var, value in dict(SLURM_NTASKS="7", SLURM_PROCID="6", SLURM_LOCALID="0", SLURM_NODEID=node_id).items():
        launch_env.setenv(var, value)
    launch_env.setenv("MASTER_ADDR", "127.0.0.1")
    launch_env.setenv("MASTER_PORT", "29500")
    launch_env.setenv("SLURM_STEP_TASKS_PER_NODE", layout)
    assert launch.read_launch_env() == (6, 0, 7, tasks)
    launch_env.delenv("SLURM_STEP_TASKS_PER_NODE")
    launch_env.setenv("SLURM_TASKS_PER_NODE", layout)  # the job's layout, where a step's is not set
    assert launch.read_launch_env() == (6, 0, 7, tasks)


def test_threads_per_rank(launch_env):
    """OMP_NUM_THREADS wins; a task that srun bound to CPUs of its own uses them all; else the cores are shared."""
    assert launch.threads_per_rank({}, 2, 8) == (4, "8 core(s) / 2 rank(s)")
    assert launch.threads_per_rank({}, 16, 8)[0] == 1
    assert launch.threads_per_rank({"OMP_NUM_THREADS": "3"}, 2, 8) == (3, "OMP_NUM_THREADS")
    assert launch.threads_per_rank({"OMP_NUM_THREADS": "3,1"}, 2, 8)[0] == 3  # OpenMP's nested form
    bound = {"SLURM_CPU_BIND_TYPE": "mask_cpu:", "SLURM_PROCID": "1"}  # srun with task/affinity
    assert launch.threads_per_rank(bound, 2, 8) == (8, "srun bound it to 8 core(s)")
    assert launch.threads_per_rank({**bound, "SLURM_CPU_BIND_TYPE": "none"}, 2, 8)[0] == 4  # --cpu-bind=none
    assert launch.threads_per_rank({**bound, "LOCAL_WORLD_SIZE": "2"}, 2, 8)[0] == 4  # torchrun inside an srun task
    for value in ("0", "four", "-1"):
        with pytest.raises(rt.RunError, match=f"OMP_NUM_THREADS must be a positive integer, got '{value}'"):
            launch.threads_per_rank({"OMP_NUM_THREADS": value}, 2, 8)


@pytest.mark.parametrize("user_set_it", [True, False])
def test_torchruns_own_omp_num_threads_is_not_the_users(user_set_it):
    """torchrun exports OMP_NUM_THREADS=1 to its workers unless the user set it: its agent's start-up environment
    tells which (here a stand-in agent, its environment as torchrun's would be at start)."""
    agent_env = {"PATH": os.environ["PATH"]} | ({"OMP_NUM_THREADS": "1"} if user_set_it else {})
    agent = subprocess.Popen(["bash", "-c", "sleep 60; true"], env=agent_env)
    try:
        wait_until(lambda: Path(f"/proc/{agent.pid}/cmdline").read_bytes().startswith(b"bash"), 30)  # exec'd
        worker_env = {"TORCHELASTIC_RUN_ID": "job", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
        assert launch.user_omp_threads(worker_env, agent.pid) == (1 if user_set_it else None)
    finally:
        agent.kill()
        agent.wait()


V1 = "cpu,cpuacct/"  # where cgroup v1 mounts the cpu controller


@pytest.mark.parametrize(
    "cgroup, files, cores",
    [
        ("0::/job/step\n", {"job/cpu.max": "50000 100000", "job/step/cpu.max": "max 100000"}, 1),  # v2, a parent's
        ("0::/\n", {"cpu.max": "max 100000"}, None),  # v2, no quota
        ("3:cpu,cpuacct:/docker/x\n", {V1 + "cpu.cfs_quota_us": "20000", V1 + "cpu.cfs_period_us": "100000"}, 1),
        ("3:cpu,cpuacct:/\n", {V1 + "cpu.cfs_quota_us": "-1", V1 + "cpu.cfs_period_us": "100000"}, None),
    ],
    ids=["v2-parent-quota", "v2-none", "v1-container-root", "v1-none"],
)
def test_usable_cores_reads_the_cgroup_cpu_quota(tmp_path, cgroup, files, cores):
    (tmp_path / "cgroup").write_text(cgroup)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text + "\n")
    expected = cores or len(os.sched_getaffinity(0))  # no quota: the affinity
    assert launch.usable_cores(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == expected


def test_launch_id_survives_restarts_and_requeues(launch_env):
    launch_env.setattr(launch.time, "time", lambda: 1700000000.5)  # two launches in the same second still differ
    first, second = launch.launch_id(), launch.launch_id()
    assert first != second
    launch_env.setenv("SLURM_JOB_ID", "77")
    assert launch.launch_id() == "slurm77"  # a batch script's own step
    launch_env.setenv("SLURM_STEP_ID", "3")  # srun: the runs of one allocation differ by step
    assert launch.launch_id() == "slurm77.3"
    launch_env.setenv("TORCHELASTIC_RUN_ID", "job-5")
    assert launch.launch_id() == "job-5"


def test_elastic_restart_guard(launch_env):
    launch.check_elastic_restarts(None)  # no --max-restarts: nothing to check
    launch_env.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    launch_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(rt.RunError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        launch.check_elastic_restarts("named")
    launch_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    with pytest.raises(rt.RunError, match="--rdzv-id"):
        launch.check_elastic_restarts(None)
    launch.check_elastic_restarts("named")
    launch_env.setenv("TORCHELASTIC_RUN_ID", "job-5")
    launch.check_elastic_restarts(None)
    launch_env.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # an elastic job restarts its workers all the same
    launch_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    launch.check_elastic_restarts(None)
    launch_env.setattr(launch, "torchrun_nnodes", lambda: "1:2")
    with pytest.raises(rt.RunError, match=r"^torchrun --nnodes=MIN:MAX needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        launch.check_elastic_restarts(None)


@pytest.mark.parametrize("agent_args", [["--nnodes=1:2"], ["--nnodes", "1:2"], ["--standalone"]])
def test_torchrun_nnodes_is_read_from_the_agents_command_line(launch_env, agent_args):
    launch_env.setenv("TORCHELASTIC_RUN_ID", "job")
    agent = subprocess.Popen(["bash", "-c", "sleep 60; true", *agent_args])  # plays the agent, its flags unread
    try:
        wait_until(lambda: Path(f"/proc/{agent.pid}/cmdline").read_bytes().startswith(b"bash"), 30)  # exec'd
        assert launch.torchrun_nnodes(agent.pid) == ("" if agent_args == ["--standalone"] else "1:2")
    finally:
        agent.kill()
        agent.wait()


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(checkpoint_every=-1), "--checkpoint-every must be 0"),
        (dict(eval_episodes=0), "--eval-episodes must be at least 1"),
        (dict(target_return=1.0), "--target-return needs --eval-every"),
        (dict(capture_video=True), "--capture-video needs --eval-every"),
        (dict(dist_timeout=0.0), "--dist-timeout must be positive"),
    ],
)
def test_run_flags_are_checked(flags, message):
    with pytest.raises(rt.RunError, match=message):
        rt.check_run_flags(Args(**flags))


def test_device_and_backend_are_values(monkeypatch):
    assert launch.choose_device(False, None, 0, 2, False) == (torch.device("cpu"), "gloo")
    with pytest.raises(rt.RunError, match="--backend nccl needs CUDA"):
        launch.choose_device(False, "nccl", 0, 1, False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU, two ranks on the node
    with pytest.raises(rt.RunError, match="NCCL cannot put two ranks on one GPU .*--backend gloo"):
        launch.choose_device(True, None, 1, 2, False)
    assert launch.choose_device(True, "gloo", 1, 2, False) == (torch.device("cuda", 0), "gloo")  # gloo shares the GPU
    assert launch.choose_device(True, None, 1, 2, True) == (torch.device("cuda", 0), "nccl")  # --share-gpus (srun)
    assert launch.choose_device(True, None, 0, 1, False) == (torch.device("cuda", 0), "nccl")
    run = single_run(Path("."))
    assert not run.on_cuda
    run.device = torch.device("cuda", 0)
    assert run.on_cuda


def test_atomic_save_keeps_the_old_file_when_a_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    checkpoint.atomic_save({"x": torch.arange(3)}, str(path))
    before = path.read_bytes()

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        checkpoint.atomic_save({"x": torch.arange(1000)}, str(path))
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_load_checkpoint_names_what_is_wrong(tmp_path):
    path = tmp_path / "checkpoint.pt"
    with pytest.raises(rt.RunError, match="no checkpoint at"):
        checkpoint.load_checkpoint(str(tmp_path), "ppo_multigpu")
    path.write_bytes(b"PK\x03\x04 torn")
    with pytest.raises(rt.RunError, match="truncated or corrupt"):
        checkpoint.load_checkpoint(str(path), "ppo_multigpu")
    torch.save({"script": "dqn_atari_multigpu"}, path)
    with pytest.raises(rt.RunError, match="written by 'dqn_atari_multigpu', not ppo_multigpu"):
        checkpoint.load_checkpoint(str(tmp_path), "ppo_multigpu")
    torch.save({"script": "ppo_multigpu", "args": {}}, path)
    with pytest.raises(rt.RunError, match="lacks agent, global_step, iteration, rank_state, rng, sizes, world_size"):
        checkpoint.load_checkpoint(str(path), "ppo_multigpu", required=("agent",))


def test_load_checkpoint_refuses_entries_of_another_type(tmp_path):
    """checkpoint.load_checkpoint: every entry each checkpoint holds is of its type (the sizes: numbers), with one
    rng and rank_state item per rank; a file that differs is refused in one line, before any of it is used."""
    good = dict(script="s", args={}, sizes=dict(num_envs=4, replay_ratio=256.0), world_size=1, iteration=1)
    good |= dict(global_step=4, rng=[None], rank_state=[None])
    path = str(tmp_path / "checkpoint.pt")
    checkpoint.atomic_save(good, path)
    assert checkpoint.load_checkpoint(path, "s")["sizes"] == good["sizes"]
    bad = [(dict(sizes=dict(num_envs="4")), "sizes (numbers)"), (dict(sizes=dict(num_envs=True)), "sizes (numbers)")]
    bad += [(dict(iteration="1"), "iteration"), (dict(rng=[None, None]), "world_size, rng, rank_state (one item")]
    for entries, what in bad:
        checkpoint.atomic_save(good | entries, path)
        with pytest.raises(rt.RunError, match=rf"has a malformed {re.escape(what)}"):
            checkpoint.load_checkpoint(path, "s")


def test_rng_states_round_trip():
    states = checkpoint.rng_states(torch.device("cpu"))
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_states(states, torch.device("cpu"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64])
def test_state_checksum_sees_one_ulp_in_every_dtype(dtype):
    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    stats = torch.linspace(1, 2, 5).to(dtype)
    before = rt.state_checksum(net, optimizer, stats)
    assert torch.equal(before, rt.state_checksum(net, optimizer, stats.clone()))
    if dtype.is_floating_point:
        stats[2] = torch.nextafter(stats[2], torch.tensor(10.0, dtype=dtype))
    else:
        stats[2] += 1
    assert not torch.equal(before, rt.state_checksum(net, optimizer, stats))
    swapped = rt.state_checksum(net, optimizer, stats.flip(0))
    assert not torch.equal(swapped, rt.state_checksum(net, optimizer, stats))  # positions count, not just values
    current = rt.state_checksum(net, optimizer, stats)
    exp_avg = optimizer.state[net.weight]["exp_avg"]  # Adam's state counts too
    exp_avg[0, 0] = torch.nextafter(exp_avg[0, 0], torch.tensor(1.0))
    assert not torch.equal(rt.state_checksum(net, optimizer, stats), current)


def test_episodes_sum_the_ended_episodes_by_name():
    """rt.Episodes: each env's running return and length; the sums of the episodes that ended, by name, once."""
    episodes = rt.Episodes(3)
    episodes.step(np.array([1.0, 2.0, 3.0]), np.array([False, True, False]))
    episodes.step(np.array([1.0, 1.0, 1.0]), np.array([True, False, False]), stepped=np.array([1, 1, 0]))
    episodes.step(np.array([5.0]), np.array([True]), envs=slice(2, 3))  # one env of a half (the async rollout)
    assert episodes.take() == dict(episode_return_sum=2.0 + 2.0 + 9.0, episode_length_sum=2 + 1 + 2, episodes=3)
    assert episodes.take() == dict(episode_return_sum=0, episode_length_sum=0, episodes=0)
    assert episodes.returns.tolist() == [0.0, 1.0, 0.0] and episodes.lengths.tolist() == [0, 1, 0]


def test_to_device_through_a_staging_buffer_or_a_new_one():
    """rt.to_device: through the caller's staging buffer (on CPU the result is that buffer), or a new one per call
    with the array's dtype (or the one asked for)."""
    staging = torch.zeros(2, 3, dtype=torch.uint8)
    out = rt.to_device(np.full((2, 3), 7, dtype=np.uint8), torch.device("cpu"), staging)
    assert out is staging and out.tolist() == [[7] * 3] * 2
    out = rt.to_device(np.arange(4, dtype=np.float64), torch.device("cpu"))
    assert out.dtype == torch.float64 and out.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert rt.to_device(np.arange(4, dtype=np.float64), torch.device("cpu"), dtype=torch.float32).dtype == torch.float32


def test_steps_crossed_keeps_a_period_that_is_not_a_multiple_of_the_batch():
    crossed = [rt.steps_crossed(s - 128, s, 300) for s in range(128, 128 * 75 + 1, 128)]
    assert sum(crossed) == 128 * 75 // 300 and max(crossed) == 1
    assert rt.steps_crossed(0, 10**6, 0) == 0  # 0 = off
    assert rt.steps_crossed(0, 16, 4) == 4  # more envs than the period: several events in one step (DQN)


PERIODIC = ("checkpoint_every", "sync_check_every", "eval_every", "log_every")


def test_every_periodic_flag_counts_global_steps_through_steps_crossed():
    """RunArgs declares the periodic flags once, in global steps; every script tests each one it reads as
    `rt.steps_crossed(prev_step, global_step, args.X)` (--eval-every inside `evals.evaluate`), never `iteration % X`."""
    run_source = (REPO / "cleanrl_ddp" / "run.py").read_text().splitlines()
    for name in PERIODIC[:3]:
        line = next(i for i, text in enumerate(run_source) if text.startswith(f"    {name}: int = "))
        assert "every N global steps" in run_source[line + 1], run_source[line + 1]
    for path in sorted((REPO / "cleanrl_ddp").glob("*_multigpu.py")):
        tree = ast.parse(path.read_text())
        args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
        declared = {n.target.id for n in args.body if isinstance(n, ast.AnnAssign)}
        assert not declared & set(PERIODIC[:3]), f"{path.name} declares a run flag again: its unit is RunArgs'"
        reads = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in PERIODIC]
        crossed = [
            n.args[2] for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "rt.steps_crossed"
        ]
        assert {"checkpoint_every", "sync_check_every"} <= {n.attr for n in reads}, path.name
        for read in reads:
            assert any(read is c for c in crossed), (
                f"{path.name}:{read.lineno}: {ast.unparse(read)} outside steps_crossed"
            )
        evaluate = next(
            n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "evals.evaluate"
        )
        assert [ast.unparse(a) for a in evaluate.args[-2:]] == ["prev_step", "global_step"], path.name


@pytest.mark.parametrize("script", ["ppo_multigpu.py", "pqn_multigpu.py"])
def test_checkpoint_and_sync_check_every_count_global_steps_in_an_iteration_loop(tmp_path, monkeypatch, capsys, script):
    """In the PPO and PQN loops too (32 global steps per iteration here): --checkpoint-every 48 saves at the
    iterations that cross 48, 96, 144 and 192 (and at the last), --sync-check-every 96 checks at 96 and 192."""
    saved, checked, save = [], [], rt.save_checkpoint
    monkeypatch.setattr(rt, "save_checkpoint", lambda run, i, *a, **k: saved.append(i) or save(run, i, *a, **k))
    monkeypatch.setattr(rt, "check_replicas_in_sync", lambda where, *a: checked.append(where))
    flags = ["--env-id", "CartPole-v1", "--local-num-envs", 2, "--num-steps", 16, "--num-minibatches", 2]
    flags += ["--update-epochs", 1, "--total-timesteps", 7 * 32, "--runs-dir", tmp_path]
    main_output(monkeypatch, capsys, script, *flags, "--checkpoint-every", 48, "--sync-check-every", 96)
    assert saved == [2, 3, 5, 6, 7] and checked == ["iteration 3", "iteration 6"]


def test_named_metrics_and_preemption_vote_in_one_process(tmp_path):
    run = single_run(tmp_path)
    assert rt.all_sum(run, {"losses/a": torch.tensor(1.5), "count": 3}) == {"losses/a": 1.5, "count": 3.0}
    assert not rt.preempted(run)
    run.signals.append(15)  # what the SIGTERM handler does
    assert rt.preempted(run)


def test_two_ranks_reduce_by_name_vote_together_and_catch_divergence(tmp_path):
    """rt.all_sum, rt.preempted and rt.check_replicas_in_sync on 2 gloo ranks (threads of their own processes)."""
    code = f"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {str(REPO)!r})
from cleanrl_ddp import runtime as rt
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=rank, world_size=2)
run = rt.Run("s", None, rank, 2, torch.device("cpu"), "gloo")
out = rt.all_sum(run, dict(b=rank + 1.0, a=10.0 * rank))
assert list(out) == ["b", "a"] and out == dict(b=3.0, a=10.0), out
if rank == 1:
    run.signals.append(15)
assert rt.preempted(run)  # one rank's signal stops both
net = torch.nn.Linear(2, 2)
torch.nn.init.constant_(net.weight, 1.0)
torch.nn.init.constant_(net.bias, 1.0)
rt.check_replicas_in_sync("iteration 1", 2, net)
with torch.no_grad():
    net.bias[0] += rank * 1e-6
try:
    rt.check_replicas_in_sync("iteration 2", 2, net)
    print("missed")
except rt.RunError as e:
    print(e.code, e)
dist.destroy_process_group()
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        assert out.startswith("3 replicas diverged at iteration 2: rank(s) [1]"), out


def test_resume_handshake_then_logs_and_checkpoint(tmp_path, monkeypatch):
    """A run directory named without '/', TensorBoard scalars with episode means, a checkpoint with every
    rank's RNG and state, and a resume that takes the checkpoint's flags (another world size: a whole-script test)."""
    monkeypatch.setattr(sys, "argv", ["script"])  # the resumed flags are parsed from this command line
    run = single_run(tmp_path, track=False)
    args, ckpt = rt.load_run(run, run.args)
    assert ckpt is None and not os.path.exists(run.run_dir)  # nothing written before the checks pass
    assert os.path.dirname(run.run_dir) == str(tmp_path) and "Z__ALE-Pong-v5__" in run.run_dir
    rt.open_run(run, rt.Sizes(world_size=1, num_envs=1, batch_size=10, num_iterations=100), None)
    rt.log(run, 10, {"losses/x": 0.5}, dict(episode_return_sum=6.0, episode_length_sum=40, episodes=2))
    rt.log(run, 20, {"losses/x": 0.25}, dict(episode_return_sum=0.0, episode_length_sum=0, episodes=0))
    rt.save_checkpoint(run, 2, 20, rank_state=b"envs", agent={"w": torch.ones(2)})
    rt.finish_or_exit_preempted(run, 20, preempted=False)
    scalars = read_scalars(run.run_dir)
    assert scalars["losses/x"] == [(10, 0.5), (20, 0.25)]
    assert scalars["charts/episodic_return"] == [(10, 3.0)] and scalars["charts/episodes"] == [(10, 2), (20, 0)]

    monkeypatch.setattr(sys, "argv", ["script", "--total-timesteps", "2000"])
    again = single_run(tmp_path)
    args, ckpt = rt.load_run(again, Args(resume=run.run_dir, total_timesteps=2000))
    assert ckpt["rank_state"] == [b"envs"] and ckpt["iteration"] == 2 and len(ckpt["rng"]) == 1
    assert args.total_timesteps == 2000 and args.env_id == "ALE/Pong-v5" and again.run_dir == run.run_dir
    with pytest.raises(rt.RunError, match="the checkpoint's batch_size is 10, not 20: keep its sizes"):
        rt.open_run(
            again, rt.Sizes(world_size=1, num_envs=1, batch_size=20, num_iterations=100), ckpt
        )  # e.g. another --local-num-envs


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_share_hands_every_env_on_in_global_order(world_size):
    """Two ranks' per-env state (lists, tensors, arrays) split again for another world size, env order kept."""
    saved = [
        (["env0", "env1"], torch.tensor([0.0, 1.0]), np.array([10, 11])),
        (["env2", "env3"], torch.tensor([2.0, 3.0]), np.array([12, 13])),
    ]
    ckpt = dict(world_size=2, rank_state=saved)
    shares = [env_state.split_for_rank(SimpleNamespace(rank=r, world_size=world_size), ckpt) for r in range(world_size)]
    assert [env for share in shares for env in share[0]] == ["env0", "env1", "env2", "env3"]
    assert torch.equal(torch.cat([share[1] for share in shares]), torch.arange(4.0))
    assert np.concatenate([share[2] for share in shares]).tolist() == [10, 11, 12, 13]
    assert all(len(share[0]) == len(share[1]) == len(share[2]) == 4 // world_size for share in shares)
    assert (
        env_state.split_for_rank(SimpleNamespace(rank=0, world_size=world_size), dict(rank_state=[None, None])) is None
    )


def test_rank_seed_is_the_seed_sequence_every_script_seeded_with():
    """rt.rank_seed(seed, rank, *more) is `int(SeedSequence([seed, rank, *more]).generate_state(1)[0])`, the value the
    scripts spelled out before: the literals below are that expression's, so runs keep reproducing bit for bit."""
    assert rt.rank_seed(1, 0) == 1835504127 and rt.rank_seed(1, 1) == 1189033389
    assert rt.rank_seed(1, 3, 7) == 880097667 and rt.rank_seed(12345, 2, 100) == 1633134622  # SAC's, TD3's samples
    for entropy in ([5, 0], [5, 1], [2**31, 3], [7, 2, 11]):
        assert rt.rank_seed(*entropy) == int(np.random.SeedSequence(entropy).generate_state(1)[0])
    assert len({rt.rank_seed(1, rank) for rank in range(64)}) == 64  # every rank a stream of its own


def test_every_script_seeds_its_ranks_through_rank_seed():
    """Each script calls `rt.rank_seed` for its per-rank streams, under its `# CRUCIAL:` seeding comment, and
    spells out no SeedSequence of its own."""
    for path in sorted((REPO / "cleanrl_ddp").glob("*_multigpu.py")):
        source = path.read_text()
        assert "rt.seed_everything(rt.rank_seed(args.seed, rank))" in source, path.name
        assert "SeedSequence" not in source, path.name
        crucial = next(line for line in source.splitlines() if "# CRUCIAL:" in line and "seeds" in line)
        assert source.index(crucial) < source.index("rt.rank_seed("), path.name


def test_resume_rng_continues_the_streams_or_seeds_them_from_seed_rank_and_iteration():
    cpu = torch.device("cpu")
    rt.seed_everything(5)
    saved = [checkpoint.rng_states(cpu), checkpoint.rng_states(cpu)]
    draws = lambda: (random.random(), np.random.rand(), torch.rand(1).item())  # noqa: E731
    expected = draws()
    ckpt = dict(world_size=2, iteration=7, rng=saved)
    rt.resume_rng(SimpleNamespace(rank=1, world_size=2, device=cpu), ckpt, seed=1)
    assert draws() == expected  # the same world size continues rank 1's own streams
    streams = {}
    for rank, iteration in [(0, 7), (1, 7), (0, 8), (0, 7)]:
        rt.resume_rng(SimpleNamespace(rank=rank, world_size=3, device=cpu), ckpt | dict(iteration=iteration), seed=1)
        streams.setdefault((rank, iteration), []).append(draws())
    assert streams[(0, 7)][0] == streams[(0, 7)][1]  # reproducible
    assert len({s[0] for s in streams.values()} | {expected}) == 4  # and new for every rank and iteration


def test_wandb_continues_the_checkpoints_run(tmp_path, monkeypatch):
    """With --track, a new run keeps the id W&B chose and saves it; a resumed run passes it back (resume="allow")."""
    import wandb

    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kw: calls.append(kw) or SimpleNamespace(id=kw["id"] or "chosen"))
    monkeypatch.setattr(wandb, "finish", lambda **kw: None)
    monkeypatch.setattr(sys, "argv", ["script"])
    run = single_run(tmp_path, track=True, run_name="tracked")
    rt.load_run(run, run.args)
    rt.open_run(run, rt.Sizes(world_size=1, num_envs=1, batch_size=10, num_iterations=100), None)
    rt.save_checkpoint(run, 1, 10, None)
    rt.finish_or_exit_preempted(run, 10, preempted=False)
    again = single_run(tmp_path, track=True, run_name="tracked")
    _, ckpt = rt.load_run(again, again.args)  # the run directory holds a checkpoint: a restart of the same run
    rt.open_run(again, rt.Sizes(world_size=1, num_envs=1, batch_size=10, num_iterations=100), ckpt)
    rt.finish_or_exit_preempted(again, 10, preempted=False)
    assert [c["id"] for c in calls] == [None, "chosen"] and ckpt["wandb_run_id"] == "chosen"
    assert calls[1]["resume"] == "allow" and calls[1]["config"]["batch_size"] == 10


def test_wandb_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    """--track without a W&B login (or network): a RunError, which open_run broadcasts as it does the claim's."""
    import wandb

    def init(**kw):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(sys, "argv", ["script"])
    run = single_run(tmp_path, track=True)
    rt.load_run(run, run.args)
    with pytest.raises(rt.RunError, match=r"^--track: W&B could not start \(UsageError: No API key configured"):
        rt.open_run(run, rt.Sizes(world_size=1, num_envs=1, batch_size=10, num_iterations=100), None)


def test_finish_after_a_preemption_exits_75(tmp_path):
    run = single_run(tmp_path)
    rt.load_run(run, run.args)
    rt.open_run(run, rt.Sizes(world_size=1, num_envs=1, batch_size=10, num_iterations=100), None)
    with pytest.raises(SystemExit) as stopped:
        rt.finish_or_exit_preempted(run, 30, preempted=True)
    assert stopped.value.code == rt.EXIT_PREEMPTED


def test_lost_rank_message_only_for_failed_collectives():
    assert rt.lost_rank_message(ValueError("x")) is None
    assert rt.lost_rank_message(RuntimeError("CUDA out of memory")) is None
    gloo = RuntimeError("[../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    assert rt.lost_rank_message(gloo) == "Connection closed by peer [127.0.0.1]:1234"
    assert rt.lost_rank_message(dist.DistError("Timed out waiting 3000ms. This is typically ...")) == (
        "Timed out waiting 3000ms"
    )


@pytest.mark.parametrize(
    "body, code, line",
    [
        ("pass", 0, None),
        ("raise rt.RunError('--x must be 1')", 2, "demo: error: --x must be 1"),
        ("raise SystemExit(rt.EXIT_PREEMPTED)", 75, None),
        ("raise rt.RunError('diverged', rt.EXIT_DIVERGED)", 3, "demo: error: diverged"),
        ("raise RuntimeError('[x.cc:1] gloo: Connection reset by peer')", 4, "demo: error: rank 0 lost contact"),
        (  # torch on the host (a real message), numpy, a GPU: out of memory is the sizes', never a traceback
            "raise RuntimeError('[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can\\'t "
            "allocate memory: you tried to allocate 180633600000 bytes. Error code 12 (Cannot allocate memory)')",
            2,
            "demo: error: ran out of memory (DefaultCPUAllocator: can't allocate memory: you tried to allocate 1806",
        ),
        (  # each rank that ran out says so: the others may have not
            "os.environ['RANK'] = '1'; rt.RANK_0_FIRST_S = 0; raise MemoryError('Unable to allocate 1.00 TiB')",
            2,
            "demo: error: rank 1: ran out of memory (MemoryError: Unable to allocate 1.00 TiB)",
        ),
        ("rt._loading[:] = ['c.pt']; raise RuntimeError('CUDA out of memory.')", 2, "demo: error: ran out of memory"),
        (  # another rank: a RunError is rank 0's to say; a state only it loaded (its envs) did not fit: it says so
            "os.environ['RANK'] = '1'; rt.RANK_0_FIRST_S = 0; raise rt.RunError('--x must be 1')",
            2,
            None,
        ),
        (
            "os.environ['RANK'] = '1'; rt.RANK_0_FIRST_S = 0; rt._loading[:] = ['c.pt']; raise ValueError('envs')",
            2,
            "demo: error: rank 1: --resume: c.pt does not fit this script (ValueError: envs); it was left as it is",
        ),
        (  # while a script loads a checkpoint's state: the file's error
            "rt._loading[:] = ['c.pt']; raise RuntimeError('size\\n\\tmismatch')",
            2,
            "demo: error: --resume: c.pt does not fit this script (RuntimeError: size mismatch); it was left as it is",
        ),
    ],
)
def test_exit_codes_one_line_each(tmp_path, monkeypatch, body, code, line):
    """`rt.exit_codes` in a forked child (it leaves with os._exit): its exit code and what it wrote to stderr."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    stderr = tmp_path / "stderr"
    pid = os.fork()
    if pid == 0:  # the child: stderr to a file, then the script's __main__ block
        try:
            fd = os.open(stderr, os.O_WRONLY | os.O_CREAT)
            os.dup2(fd, 2)
            sys.stderr = open(2, "w", closefd=False)
            with rt.exit_codes("demo"):
                exec(body)
        finally:
            os._exit(99)  # never reached when exit_codes leaves as it should; never back into pytest
    _, status = os.waitpid(pid, 0)
    lines = stderr.read_text().strip().splitlines()
    assert os.waitstatus_to_exitcode(status) == code, lines
    assert lines == ([] if line is None else lines[:1]) and (line is None or lines[0].startswith(line)), lines


def test_check_env_names_the_space_and_ends_with_the_hint():
    import gymnasium as gym

    def make_env(env_id):
        return lambda: gym.make(env_id)

    rt.check_env("CartPole-v1", make_env, gym.spaces.Discrete, hint="try X")
    with pytest.raises(rt.RunError, match=r"CartPole-v1 has a Discrete action space; this script needs a Box one \(t"):
        rt.check_env("CartPole-v1", make_env, gym.spaces.Box, hint="try X")
    with pytest.raises(rt.RunError, match=r"^unknown --env-id 'NoSuchEnv-v0' \(\w+\); try X$"):
        rt.check_env("NoSuchEnv-v0", make_env, gym.spaces.Box, hint="try X")
