#!/usr/bin/env bash
# CleanRL's pqn.py protocol: CartPole-v1, Acrobot-v1, MountainCar-v0, 500k steps, 3 seeds, at world size 1 (CleanRL's
# 4 envs, one core) and world size N (default 2) with the same global batch (4 / N envs per rank, one core each).
# Report: docs/benchmarks/pqn_multigpu/.
# Usage (from the repository root): bash benchmark/repro/pqn_multigpu.sh; N=4 bash ...; SLURM=FILE.sbatch bash
# benchmark/repro/pqn_multigpu.sh writes SLURM array jobs instead
set -euo pipefail
slurm() { [ -z "${SLURM:-}" ] || echo --slurm "${SLURM%.sbatch}$1.sbatch"; }
RUNS=${RUNS:-runs/repro_pqn_multigpu}
STEPS=${STEPS:-500000}
N=${N:-2}
read -r -a ENVS <<< "${ENVS:-CartPole-v1 Acrobot-v1 MountainCar-v0}"
common=(--script cleanrl_ddp/pqn_multigpu.py --env-ids "${ENVS[@]}" --seeds 1 2 3 --runs-dir "$RUNS")
ONE_CORE=$([ -z "${SLURM:-}" ] && command -v taskset >/dev/null && echo "taskset -c 0" || true)
$ONE_CORE python -m benchmark.harness run "${common[@]}" --world-sizes 1 $(slurm -ws1) -- --local-num-envs 4 --total-timesteps "$STEPS"
python -m benchmark.harness run "${common[@]}" --world-sizes "$N" $(slurm "-ws$N") -- --local-num-envs $((4 / N)) --total-timesteps "$STEPS"
[ -n "${SLURM:-}" ] || python -m benchmark.harness report --runs-dir "$RUNS" --out docs/benchmarks/pqn_multigpu
