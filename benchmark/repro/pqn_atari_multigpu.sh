#!/usr/bin/env bash
# CleanRL's pqn_atari_envpool.py protocol: Breakout, SpaceInvaders, BeamRider, Pong, MsPacman (NoFrameskip-v4: no
# sticky actions, as EnvPool's Breakout-v5 defaults), 10M steps, 3 seeds, at world size 1 (CleanRL's 8 envs) and
# world size N (default 2) with the same global batch (8 / N envs per rank). One GPU per rank: a job for a GPU machine.
# Report: docs/benchmarks/pqn_atari_multigpu/.
# Usage (from the repository root): bash benchmark/repro/pqn_atari_multigpu.sh; N=4 bash ...; SLURM=FILE.sbatch bash
# benchmark/repro/pqn_atari_multigpu.sh writes SLURM array jobs instead
set -euo pipefail
slurm() { [ -z "${SLURM:-}" ] || echo --slurm "${SLURM%.sbatch}$1.sbatch"; }
RUNS=${RUNS:-runs/repro_pqn_atari_multigpu}
STEPS=${STEPS:-10000000}
N=${N:-2}
GAMES=(BreakoutNoFrameskip-v4 SpaceInvadersNoFrameskip-v4 BeamRiderNoFrameskip-v4 PongNoFrameskip-v4 MsPacmanNoFrameskip-v4)
common=(--script cleanrl_ddp/pqn_atari_multigpu.py --env-ids "${GAMES[@]}" --seeds 1 2 3 --runs-dir "$RUNS")
python -m benchmark.harness run "${common[@]}" --world-sizes 1 $(slurm -ws1) -- --local-num-envs 8 --total-timesteps "$STEPS"
python -m benchmark.harness run "${common[@]}" --world-sizes "$N" $(slurm "-ws$N") -- --local-num-envs $((8 / N)) --total-timesteps "$STEPS"
[ -n "${SLURM:-}" ] || python -m benchmark.harness report --runs-dir "$RUNS" --out docs/benchmarks/pqn_atari_multigpu
