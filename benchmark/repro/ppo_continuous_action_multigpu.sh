#!/usr/bin/env bash
# MuJoCo (CleanRL's ppo_continuous_action protocol: 1M steps, 3 seeds), here on 2 ranks x 1 env.
# Needs the mujoco extra: pip install -e ".[mujoco]". Report: docs/benchmarks/ppo_continuous_action_multigpu/.
# Usage (from the repository root): bash benchmark/repro/ppo_continuous_action_multigpu.sh; SLURM=FILE.sbatch bash benchmark/repro/ppo_continuous_action_multigpu.sh writes SLURM array jobs instead
set -euo pipefail
slurm() { [ -z "${SLURM:-}" ] || echo --slurm "${SLURM%.sbatch}$1.sbatch"; }
RUNS=${RUNS:-runs/repro_ppo_continuous_action_multigpu}
STEPS=${STEPS:-1000000}
python -m benchmark.harness run --script cleanrl_ddp/ppo_continuous_action_multigpu.py \
    --env-ids HalfCheetah-v5 Walker2d-v5 Hopper-v5 --seeds 1 2 3 \
    --world-sizes 2 --runs-dir "$RUNS" $(slurm "") -- --local-num-envs 1 --total-timesteps "$STEPS"
[ -n "${SLURM:-}" ] || python -m benchmark.harness report --runs-dir "$RUNS" --out docs/benchmarks/ppo_continuous_action_multigpu
