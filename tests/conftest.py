"""Settings of the test session. The suite runs on three pytest-xdist workers (pyproject.toml's addopts), each
launching scripts that use every core, so the cores are oversubscribed: OpenMP's idle threads then sleep instead of
spinning (OMP_WAIT_POLICY=PASSIVE), leaving the cores to the other worker's processes. It changes no result, only
how idle threads wait; every process a test starts inherits it.

The workers take whole files (`--dist loadfile`), each the next file in collection order when it runs low: the
longest files come first (FIRST), so that the last ones are short and the workers end together. SLURM's tests
come first of all: they mostly wait on SLURM's clocks, while the two other workers keep the cores busy."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# longest first: by their CPU time and slowest tests in .ci/run on the 2-core machine (2026-11-26); SLURM by wall time
FIRST = (
    "test_slurm.py",
    "test_fault_tolerance.py",
    "test_distributed_correctness.py",
    "test_gpu_check.py",
    "test_evaluation.py",
    "test_sac_continuous_action_multigpu.py",
    "test_td3_continuous_action_multigpu.py",
    "test_ppo_continuous_action_multigpu.py",
)


def pytest_collection_modifyitems(session, config, items):
    """FIRST's files first, in its order, then the others as collected; each file's tests keep their order."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))
