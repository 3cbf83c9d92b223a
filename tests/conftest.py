"""Settings of the test session. The suite runs on three pytest-xdist workers (pyproject.toml's addopts) on a
machine of two cores, so the cores are oversubscribed: every process runs one torch thread (OMP_NUM_THREADS=1; a
second thread buys a process little time and costs the other workers' processes much: SAC's learning run alone took
112 CPU-seconds in 58 s with two threads, 65 in 65 s with one), and OpenMP's idle threads sleep instead of spinning
(OMP_WAIT_POLICY=PASSIVE). Every process a test starts inherits both; the tests of the scripts' own thread rule
(tests/test_runtime.py, SLURM's jobs in tests/test_slurm.py) set or clear OMP_NUM_THREADS themselves.

The workers take whole files (`--dist loadfile`); a worker gets the next file in collection order when its own is
nearly done. The longest files come first (FIRST), so that the last ones are short and the workers end together;
SLURM's tests, which mostly wait on SLURM's clocks, start at once beside the two longest."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# longest first: by each file's seconds on its worker in a whole run on the 2-core machine (2026-11-28, three
# workers)
FIRST = (
    "test_fault_tolerance.py",  # 366 s
    "test_distributed_correctness.py",  # 315
    "test_slurm.py",  # 260, mostly waiting
    "test_gpu_check.py",  # 210
    "test_evaluation.py",  # 103
    "test_td3_continuous_action_multigpu.py",  # 101
    "test_sac_continuous_action_multigpu.py",  # 76
    "test_benchmark_throughput.py",  # 70
    "test_run_in_calls.py",  # 65
    "test_benchmark_harness.py",  # 63
    "test_ppo_continuous_action_multigpu.py",  # 58
    "test_host_syncs.py",  # 36
    "test_cudagraphs.py",  # 31
    "test_ppo_multigpu.py",  # 24
    "test_checkpoint_safety.py",  # 18
    "test_runtime.py",  # 11
    "test_bad_inputs.py",  # 9
    "test_ppo_atari_multigpu.py",  # 9
    "test_ppo_atari_async_multigpu.py",  # 7
    "test_dqn_atari_multigpu.py",  # 5
)


def pytest_collection_modifyitems(session, config, items):
    """FIRST's files first, in its order, then the others as collected; each file's tests keep their order."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))
