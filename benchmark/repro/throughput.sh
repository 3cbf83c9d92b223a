#!/usr/bin/env bash
# Throughput and weak scaling of every script on this machine: steady-state global SPS at world sizes
# 1, 2 and 3 with one core per rank (all cores once they run out), ddp vs flat gradient sync, the
# env-only ceiling and the time shares, plus fp32 vs bf16 for the Atari PPO. Tables and SPS-vs-world-size
# plots: docs/benchmarks/throughput/<script>/ (or $REPORTS/<script>/). Takes about 30 minutes on a quiet 2-core CPU.
# Usage (from the repository root): bash benchmark/repro/throughput.sh [SCRIPT_STEM ...] (default: all)
set -euo pipefail
REPORTS=${REPORTS:-docs/benchmarks/throughput}
grid=(--world-sizes 1 2 3 --cores-per-rank 1 --variant ddp= --variant flat="--grad-sync flat")
want() { [ $# -eq 0 ] || [[ " $* " == *" $stem "* ]]; }
stem=ppo_atari_multigpu; if want "$@"; then
  python -m benchmark.throughput --script cleanrl_ddp/$stem.py --env-id BreakoutNoFrameskip-v4 "${grid[@]}" \
    --local-num-envs 4 --num-steps 128 --iterations 10 --warmup 3 --repeats 2 --out "$REPORTS/$stem"
  python -m benchmark.throughput --script cleanrl_ddp/$stem.py --env-id BreakoutNoFrameskip-v4 --world-sizes 2 \
    --cores-per-rank 1 --variant fp32= --variant bf16="--precision bf16" --local-num-envs 4 --num-steps 128 \
    --iterations 10 --warmup 3 --repeats 1 --ceiling-steps 0 --out "$REPORTS/${stem}_precision"
fi
stem=ppo_multigpu; if want "$@"; then
  python -m benchmark.throughput --script cleanrl_ddp/$stem.py --env-id CartPole-v1 "${grid[@]}" \
    --local-num-envs 4 --num-steps 128 --iterations 30 --warmup 5 --repeats 2 --out "$REPORTS/$stem"
fi
stem=ppo_continuous_action_multigpu; if want "$@"; then
  python -m benchmark.throughput --script cleanrl_ddp/$stem.py --env-id HalfCheetah-v5 "${grid[@]}" \
    --local-num-envs 1 --num-steps 2048 --iterations 6 --warmup 2 --repeats 1 --out "$REPORTS/$stem"
fi
stem=dqn_atari_multigpu; if want "$@"; then  # no rollout: one iteration is one step of every env
  python -m benchmark.throughput --script cleanrl_ddp/$stem.py --env-id BreakoutNoFrameskip-v4 "${grid[@]}" \
    --local-num-envs 4 --num-steps 0 --iterations 400 --warmup 3 --repeats 1 --out "$REPORTS/$stem" \
    -- --learning-starts 400 --buffer-size 24000 --log-every 200  # buffer: divisible by 1, 2 and 3 ranks
fi
