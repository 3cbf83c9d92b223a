#!/usr/bin/env bash
# Wheels for a node without internet (a compute node, a GPU machine with no registry) that has Python 3.12 on x86-64
# Linux and torch already: run this where PyPI is reachable; it downloads into the repository's .whl/ (git-ignored
# through .git/info/exclude). Copy .whl/ to the node with the checkout, then install there without a registry:
#   python3 -m pip install --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site ENVPOOL_ASSETS_PATH=$PWD/.whl/envpool_assets
# What it gathers, at the lock's versions (requirements/lock.txt, as the CPU suite runs them):
# - the scripts' own needs: gymnasium, ale-py, tyro (and docstring-parser, typeguard, farama-notifications);
#   the MuJoCo extra: mujoco, mujoco-core, mujoco-studio, glfw, pyopengl, websockets;
# - tensordict (CUDA graphs; LeanRL's script) and pyvers (its other needs, numpy and cloudpickle, are not gathered);
# - for gpu_check's leanrl: rows (LeanRL's SAC and TD3): torchrl 0.14.1 and hoptorch (torchrl asks for tensordict
#   below 0.15 but runs LeanRL's scripts with the lock's 0.15.3: installed with --no-deps, as above);
# - for gpu_check's LeanRL row: EnvPool 1.2.7, trimmed from 64 MB to its Atari env (atari_envpool.so and the Python
#   files, only Atari registered), its needs dm-env, dm-tree and optree, and the Breakout ROM (from ale-py's wheel) in
#   .whl/envpool_assets/atari/roms/, where ENVPOOL_ASSETS_PATH points EnvPool.
# It ends with the size of .whl/ and of the repository's files. Run from anywhere in the checkout:
#   bash benchmark/offline_wheels.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
rm -rf .whl && mkdir -p .whl/envpool_assets/atari/roms
tmp="$(mktemp -d)" && trap 'rm -rf "$tmp"' EXIT
platforms=()
for p in manylinux_2_{17,24,27,28,31,34,35}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$@" 2>&1 | grep -v '^WARNING: Location' || true
}
# the suite's versions (requirements/lock.txt, the same for every Python: no marker), and EnvPool's needs
locked() { for name in "$@"; do grep -E "^$name==[^ ;]+$" requirements/lock.txt || { echo "$name: not in the lock" >&2; exit 1; }; done; }
download .whl $(locked gymnasium ale-py farama-notifications tyro docstring-parser typeguard \
    mujoco mujoco-core mujoco-studio glfw pyopengl websockets tensordict pyvers) dm-env==1.6 dm-tree==0.1.10 optree==0.20.0 \
    torchrl==0.14.1 hoptorch==0.1.4
download "$tmp" envpool==1.2.7
ale=$(locked ale-py)
python3 - "$tmp"/envpool-1.2.7-*.whl .whl/ale_py-"${ale#ale-py==}"-*.whl <<'EOF'
"""EnvPool's wheel with its Atari env alone (a valid wheel: RECORD rewritten), and the Breakout ROM beside it."""
import base64, hashlib, sys, zipfile
from pathlib import Path

source, ale = sys.argv[1:3]
keep = ("envpool/__init__.py", "envpool/entry.py", "envpool/registration.py", "envpool/py.typed", "envpool/python/",
        "envpool/atari/__init__.py", "envpool/atari/registration.py", "envpool/atari/atari_envpool.so")
entry = b'"""Entry point for the envs\' registration: Atari only (trimmed by benchmark/offline_wheels.sh)."""\n\n'
entry += b"import envpool.atari.registration  # noqa: F401\n"
target = Path(".whl") / Path(source).name
with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
    dist_info = next(n.split("/")[0] for n in src.namelist() if n.endswith(".dist-info/WHEEL"))
    record = []
    for name in src.namelist():
        if not (name.startswith(keep) or name in (f"{dist_info}/{f}" for f in ("METADATA", "WHEEL", "top_level.txt"))):
            continue
        data = entry if name == "envpool/entry.py" else src.read(name)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
        out.writestr(name, data)
    out.writestr(f"{dist_info}/RECORD", "\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n")
with zipfile.ZipFile(ale) as wheel:
    Path(".whl/envpool_assets/atari/roms/breakout.bin").write_bytes(wheel.read("ale_py/roms/breakout.bin"))
print(f"{target}: {target.stat().st_size / 2**20:.1f} MiB (EnvPool's Atari env alone)")
EOF
ls -l .whl
wheels=$(du -cb .whl | tail -1 | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk '/\ttotal$/ {s += $1} END {print s}')
echo "offline wheels: .whl/ $((wheels / 1024 / 1024)) MiB; the repository's files $((tree / 1024 / 1024)) MiB"
