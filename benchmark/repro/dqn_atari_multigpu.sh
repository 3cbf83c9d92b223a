#!/usr/bin/env bash
# CleanRL's dqn_atari protocol: Pong, BeamRider, Breakout (NoFrameskip-v4), 10M steps, 3 seeds; here on
# 2 ranks. Report: docs/benchmarks/dqn_atari_multigpu/.
# Usage (from the repository root): bash benchmark/repro/dqn_atari_multigpu.sh; SLURM=FILE.sbatch bash benchmark/repro/dqn_atari_multigpu.sh writes SLURM array jobs instead
set -euo pipefail
slurm() { [ -z "${SLURM:-}" ] || echo --slurm "${SLURM%.sbatch}$1.sbatch"; }
RUNS=${RUNS:-runs/repro_dqn_atari_multigpu}
STEPS=${STEPS:-10000000}
python -m benchmark.harness run --script cleanrl_ddp/dqn_atari_multigpu.py \
    --env-ids PongNoFrameskip-v4 BeamRiderNoFrameskip-v4 BreakoutNoFrameskip-v4 --seeds 1 2 3 \
    --world-sizes 2 --runs-dir "$RUNS" $(slurm "") -- --total-timesteps "$STEPS"
[ -n "${SLURM:-}" ] || python -m benchmark.harness report --runs-dir "$RUNS" --out docs/benchmarks/dqn_atari_multigpu
