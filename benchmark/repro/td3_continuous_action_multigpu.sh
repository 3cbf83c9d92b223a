#!/usr/bin/env bash
# MuJoCo TD3 (CleanRL's td3_continuous_action protocol: 1M steps, 3 seeds; its published returns are on v4 envs),
# world size 1 with CleanRL's defaults against 2 ranks with the same global batch (256), one update per global step
# and so the same replay ratio: --local-batch-size 128 --updates-per-iteration 2.
# Needs the mujoco extra: pip install -e ".[mujoco]". Report: docs/benchmarks/td3_continuous_action_multigpu/.
# Usage (from the repository root): bash benchmark/repro/td3_continuous_action_multigpu.sh; SLURM=FILE.sbatch bash benchmark/repro/td3_continuous_action_multigpu.sh writes SLURM array jobs instead
set -euo pipefail
slurm() { [ -z "${SLURM:-}" ] || echo --slurm "${SLURM%.sbatch}$1.sbatch"; }
RUNS=${RUNS:-runs/repro_td3_continuous_action_multigpu}
STEPS=${STEPS:-1000000}
ENVS="HalfCheetah-v5 Walker2d-v5 Hopper-v5"
python -m benchmark.harness run --script cleanrl_ddp/td3_continuous_action_multigpu.py \
    --env-ids $ENVS --seeds 1 2 3 --world-sizes 1 --runs-dir "$RUNS" $(slurm -ws1) -- --total-timesteps "$STEPS"
python -m benchmark.harness run --script cleanrl_ddp/td3_continuous_action_multigpu.py \
    --env-ids $ENVS --seeds 1 2 3 --world-sizes 2 --runs-dir "$RUNS" $(slurm -ws2) -- --total-timesteps "$STEPS" \
    --local-batch-size 128 --updates-per-iteration 2
[ -n "${SLURM:-}" ] || python -m benchmark.harness report --runs-dir "$RUNS" --out docs/benchmarks/td3_continuous_action_multigpu
