#!/usr/bin/env bash
# CleanRL's published ppo_atari_multigpu protocol: Pong, BeamRider, Breakout (NoFrameskip-v4, no sticky
# actions), 10M global steps, 3 seeds, 2 ranks x 4 envs (8 envs, as ppo_atari.py). Compare with the
# table in CleanRL's docs (see docs/ppo_atari_multigpu.md). Report: docs/benchmarks/ppo_atari_multigpu/.
# Usage (from the repository root): bash benchmark/repro/ppo_atari_multigpu.sh; SLURM=FILE.sbatch bash benchmark/repro/ppo_atari_multigpu.sh writes SLURM array jobs instead
set -euo pipefail
slurm() { [ -z "${SLURM:-}" ] || echo --slurm "${SLURM%.sbatch}$1.sbatch"; }
RUNS=${RUNS:-runs/repro_ppo_atari_multigpu}
STEPS=${STEPS:-10000000}
python -m benchmark.harness run --script cleanrl_ddp/ppo_atari_multigpu.py \
    --env-ids PongNoFrameskip-v4 BeamRiderNoFrameskip-v4 BreakoutNoFrameskip-v4 --seeds 1 2 3 \
    --world-sizes 2 --runs-dir "$RUNS" $(slurm "") -- --local-num-envs 4 --total-timesteps "$STEPS"
[ -n "${SLURM:-}" ] || python -m benchmark.harness report --runs-dir "$RUNS" --out docs/benchmarks/ppo_atari_multigpu
