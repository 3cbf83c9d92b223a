#!/usr/bin/env bash
# MuJoCo PPO at CleanRL's ppo_continuous_action protocol (1M global steps, 3 seeds; its published returns, on v4
# envs, are in benchmark/published_returns.csv), in three configurations:
#   ws1               1 process, CleanRL's batch: 1 env x 2048 steps
#   ws2-same-batch    2 ranks x 1 env x 1024 steps: the same global batch (2048), the equivalence claim
#   ws2-double-batch  2 ranks x 1 env x 2048 steps: the global batch doubles (4096), as users launch it
# Needs the mujoco extra: pip install -e ".[mujoco]". Report: docs/benchmarks/ppo_continuous_action_multigpu/.
# One thread per process (OMP_NUM_THREADS=1), and the world-size-1 runs JOBS (2) at a time: on 2 cores every
# configuration then has one core per process.
# Usage (from the repository root): bash benchmark/repro/ppo_continuous_action_multigpu.sh; SEEDS="1" runs seed 1
# only; SLURM=FILE.sbatch bash benchmark/repro/ppo_continuous_action_multigpu.sh writes SLURM array jobs instead
set -euo pipefail
slurm() { [ -z "${SLURM:-}" ] || echo --slurm "${SLURM%.sbatch}$1.sbatch"; }
RUNS=${RUNS:-runs/repro_ppo_continuous_action_multigpu}
STEPS=${STEPS:-1000000}
SEEDS=${SEEDS:-1 2 3}
JOBS=${JOBS:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
grid() { python -m benchmark.harness run --script cleanrl_ddp/ppo_continuous_action_multigpu.py \
    --env-ids HalfCheetah-v5 Walker2d-v5 Hopper-v5 --seeds $SEEDS --runs-dir "$RUNS" "$@"; }
grid --world-sizes 1 --label ws1 --jobs "$JOBS" $(slurm -ws1) -- --total-timesteps "$STEPS" --num-steps 2048
grid --world-sizes 2 --label ws2-same-batch $(slurm -ws2-same-batch) -- --total-timesteps "$STEPS" --num-steps 1024
grid --world-sizes 2 --label ws2-double-batch $(slurm -ws2-double-batch) -- --total-timesteps "$STEPS" --num-steps 2048
[ -n "${SLURM:-}" ] || python -m benchmark.harness report --runs-dir "$RUNS" \
    --out docs/benchmarks/ppo_continuous_action_multigpu --tags charts/ losses/approx_kl losses/explained_variance
