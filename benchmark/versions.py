"""The versions a measurement ran with, written next to its results (harness reports, throughput tables).

    python -m benchmark.versions     # this environment's line, as the reports print it

Results move with these packages: torch (and the CUDA it was built with) for speed and numerics, gymnasium,
ale-py and MuJoCo for the environments, numpy for the envs' and the scripts' host-side arithmetic, tensordict
for the CUDA-graph paths. The locked set that the suite passed with is requirements/lock.txt (docs/results.md,
"The locked packages").
"""

import pathlib
import platform
import re
import subprocess
from importlib import metadata

PACKAGES = ("torch", "gymnasium", "ale-py", "mujoco", "numpy", "tensordict")


def package_versions() -> dict[str, str]:
    """{name: version} of Python, CUDA and PACKAGES in this environment ("-" where a package is not installed).
    torch's is its build (`2.13.0+cpu`), as installed; CUDA's is the toolkit that torch was built with."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "-"
    found["cuda"] = torch_cuda_build() if found["torch"] != "-" else "-"
    return found


def torch_cuda_build() -> str:
    """The CUDA toolkit torch was built with, read as text from its `torch/version.py` (`cuda: ... = '12.8'` or
    `None`), so that recording versions imports no torch (~200 MB in a process that waits on runs for hours)."""
    try:
        text = pathlib.Path(metadata.distribution("torch").locate_file("torch/version.py")).read_text()
    except OSError:
        return "?"
    builds = dict(re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(?:None|'([^']*)')", text, re.MULTILINE))
    if "cuda" not in builds:
        return "?"
    return builds["cuda"] or (f"none (ROCm {builds['hip']})" if builds.get("hip") else "none (CPU build)")


def source_commit(path: str) -> str:
    """The commit of the checkout holding `path`: its short hash, `+changes` if tracked files differ; `-` if none."""

    def git(*args):
        return subprocess.run(["git", *args], cwd=path, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "-"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def versions_line(versions: dict[str, str]) -> str:
    """`torch 2.13.0+cpu (CUDA none (CPU build)), gymnasium 1.4.0, ...` in PACKAGES' order, then Python."""
    names = ", ".join(f"{name} {versions.get(name, '?')}" for name in PACKAGES[1:])
    torch = f"torch {versions.get('torch', '?')} (CUDA {versions.get('cuda', '?')})"
    return f"{torch}, {names}, Python {versions.get('python', '?')}"


if __name__ == "__main__":
    print(versions_line(package_versions()))
