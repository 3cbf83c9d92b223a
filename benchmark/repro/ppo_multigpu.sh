#!/usr/bin/env bash
# CartPole-v1, 3 seeds, world size 1 and 2 at the same global batch (8 envs x 128 steps), world size 1 pinned
# to one core and world size 2 on two (one thread per rank):
# data parallelism should change speed, not learning. Report: docs/benchmarks/ppo_multigpu/.
# Usage (from the repository root): bash benchmark/repro/ppo_multigpu.sh; SLURM=FILE.sbatch bash benchmark/repro/ppo_multigpu.sh writes SLURM array jobs instead
set -euo pipefail
slurm() { [ -z "${SLURM:-}" ] || echo --slurm "${SLURM%.sbatch}$1.sbatch"; }
RUNS=${RUNS:-runs/repro_ppo_multigpu}
STEPS=${STEPS:-500000}
common=(--script cleanrl_ddp/ppo_multigpu.py --env-ids CartPole-v1 --seeds 1 2 3 --runs-dir "$RUNS")
ONE_CORE=$([ -z "${SLURM:-}" ] && command -v taskset >/dev/null && echo "taskset -c 0" || true)
$ONE_CORE python -m benchmark.harness run "${common[@]}" --world-sizes 1 $(slurm -ws1) -- --local-num-envs 8 --total-timesteps "$STEPS"
python -m benchmark.harness run "${common[@]}" --world-sizes 2 $(slurm -ws2) -- --local-num-envs 4 --total-timesteps "$STEPS"
[ -n "${SLURM:-}" ] || python -m benchmark.harness report --runs-dir "$RUNS" --out docs/benchmarks/ppo_multigpu
