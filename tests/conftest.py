"""Settings of the test session. The suite runs on three pytest-xdist workers (pyproject.toml's addopts) on a
machine of two cores, so the cores are oversubscribed: every process runs one torch thread (OMP_NUM_THREADS=1; a
second thread buys a process little time and costs the other workers' processes much: SAC's learning run alone took
112 CPU-seconds in 58 s with two threads, 65 in 65 s with one), and OpenMP's idle threads sleep instead
of spinning (OMP_WAIT_POLICY=PASSIVE). Every process a test starts inherits both; the tests of the scripts' own
thread rule (tests/test_runtime.py, SLURM's jobs in tests/test_slurm.py) set or clear OMP_NUM_THREADS themselves.

The workers take whole files (`--dist loadfile`), each the next file in collection order when it runs low: the
longest files come first (FIRST), so that the last ones are short and the workers end together. SLURM's tests
come first of all: they mostly wait on SLURM's clocks, while the two other workers keep the cores busy."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# longest first: by each file's seconds on its worker in a whole run on the 2-core machine (2026-11-27, three
# workers), SLURM's first: it mostly waits
FIRST = (
    "test_slurm.py",  # 225 s, mostly waiting
    "test_fault_tolerance.py",  # 420
    "test_distributed_correctness.py",  # 355
    "test_gpu_check.py",  # 186
    "test_evaluation.py",  # 110
    "test_benchmark_throughput.py",  # 97
    "test_ppo_continuous_action_multigpu.py",  # 84
    "test_ppo_multigpu.py",  # 70
    "test_sac_continuous_action_multigpu.py",  # 68
    "test_benchmark_harness.py",  # 60
    "test_td3_continuous_action_multigpu.py",  # 56
    "test_run_in_calls.py",  # 53
    "test_ppo_atari_multigpu.py",  # 47
    "test_dqn_atari_multigpu.py",  # 45
    "test_host_syncs.py",  # 40
    "test_checkpoint_safety.py",  # 36
    "test_cudagraphs.py",  # 25
    "test_runtime.py",  # 23
    "test_ppo_atari_async_multigpu.py",  # 20
)


def pytest_collection_modifyitems(session, config, items):
    """FIRST's files first, in its order, then the others as collected; each file's tests keep their order."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))
