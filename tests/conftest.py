"""Settings of the test session. The suite runs on two pytest-xdist workers (pyproject.toml's addopts), each
launching scripts that use every core, so the cores are oversubscribed: OpenMP's idle threads then sleep instead of
spinning (OMP_WAIT_POLICY=PASSIVE), leaving the cores to the other worker's processes. It changes no result, only
how idle threads wait; every process a test starts inherits it."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
