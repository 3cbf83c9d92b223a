"""Settings of the test session. The suite runs on three pytest-xdist workers (pyproject.toml's addopts), each
launching scripts that use every core, so the cores are oversubscribed: OpenMP's idle threads then sleep instead of
spinning (OMP_WAIT_POLICY=PASSIVE), leaving the cores to the other worker's processes. It changes no result, only
how idle threads wait; every process a test starts inherits it.

The workers take whole files (`--dist loadfile`), each the next file in collection order when it runs low: the
longest files come first (FIRST), so that the last ones are short and the workers end together. SLURM's tests
come first of all: they mostly wait on SLURM's clocks, while the two other workers keep the cores busy."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# longest first: by each file's seconds in .ci/run on the 2-core machine (2026-11-26, three workers), SLURM's first
FIRST = (
    "test_slurm.py",  # 134 s, mostly waiting
    "test_fault_tolerance.py",  # 502
    "test_distributed_correctness.py",  # 470
    "test_evaluation.py",  # 170
    "test_gpu_check.py",  # 106
    "test_sac_continuous_action_multigpu.py",  # 101
    "test_td3_continuous_action_multigpu.py",  # 88
    "test_ppo_multigpu.py",  # 79
    "test_ppo_continuous_action_multigpu.py",  # 75
    "test_host_syncs.py",  # 63
    "test_dqn_atari_multigpu.py",  # 57
    "test_benchmark_throughput.py",  # 55
    "test_run_in_calls.py",  # about 35 s alone
    "test_benchmark_harness.py",  # 43
    "test_ppo_atari_multigpu.py",  # 32
    "test_repo.py",  # 30
    "test_cudagraphs.py",  # 24
)


def pytest_collection_modifyitems(session, config, items):
    """FIRST's files first, in its order, then the others as collected; each file's tests keep their order."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))
