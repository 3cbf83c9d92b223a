"""Settings of the test session. The suite runs on three pytest-xdist workers (pyproject.toml's addopts), each
launching scripts that use every core, so the cores are oversubscribed: OpenMP's idle threads then sleep instead of
spinning (OMP_WAIT_POLICY=PASSIVE), leaving the cores to the other worker's processes. It changes no result, only
how idle threads wait; every process a test starts inherits it.

The workers take whole files (`--dist loadfile`), each the next file in collection order when it runs low: the
longest files come first (FIRST), so that the last ones are short and the workers end together. SLURM's tests
come first of all: they mostly wait on SLURM's clocks, while the two other workers keep the cores busy."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# longest first: by each file's seconds in a whole run on the 2-core machine (2026-11-27, three workers; SAC's and
# TD3's learning tests since moved to one process), SLURM's first
FIRST = (
    "test_slurm.py",  # 256 s, mostly waiting
    "test_distributed_correctness.py",  # 941
    "test_fault_tolerance.py",  # 803
    "test_evaluation.py",  # 233
    "test_gpu_check.py",  # 238, about 180 with one graphs: row
    "test_benchmark_throughput.py",  # 128
    "test_ppo_continuous_action_multigpu.py",  # 124
    "test_ppo_multigpu.py",  # 110
    "test_sac_continuous_action_multigpu.py",  # 112
    "test_td3_continuous_action_multigpu.py",  # 83
    "test_dqn_atari_multigpu.py",  # 89, about 65 with one 2-rank run
    "test_benchmark_harness.py",  # 72
    "test_host_syncs.py",  # 63
    "test_ppo_atari_multigpu.py",  # 59
    "test_run_in_calls.py",  # 58
    "test_checkpoint_safety.py",  # 53
    "test_cudagraphs.py",  # 51
    "test_ppo_atari_async_multigpu.py",  # 50
)


def pytest_collection_modifyitems(session, config, items):
    """FIRST's files first, in its order, then the others as collected; each file's tests keep their order."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))
