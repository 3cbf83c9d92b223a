#!/usr/bin/env bash
# Every script's speed in two checkouts of this repository, side by side: OLD's then NEW's run of the same command,
# script after script, one process and one torch thread each, --checkpoint-every 0; the steady SPS of each (its
# first 3 logged points left out), appended to RESULTS_DIR/results.txt. For a change's cost on a quiet machine:
#   git worktree add /tmp/old <commit> && bash benchmark/repro/versions_speed.sh /tmp/old . /tmp/versions_speed
# The MuJoCo scripts need the mujoco extra. About 8 minutes on a 2-core CPU.
set -u
mkdir -p "$3"
OLD=$(cd "$1" && pwd); NEW=$(cd "$2" && pwd); RESULTS=$(cd "$3" && pwd)
configs=(
  "ppo_multigpu.py|--env-id CartPole-v1 --total-timesteps 40960"
  "ppo_atari_multigpu.py|--env-id BreakoutNoFrameskip-v4 --local-num-envs 4 --total-timesteps 8192"
  "ppo_atari_async_multigpu.py|--env-id BreakoutNoFrameskip-v4 --local-num-envs 4 --total-timesteps 8192"
  "ppo_continuous_action_multigpu.py|--env-id HalfCheetah-v5 --total-timesteps 16384"
  "pqn_multigpu.py|--env-id CartPole-v1 --total-timesteps 40960"
  "pqn_atari_multigpu.py|--env-id BreakoutNoFrameskip-v4 --local-num-envs 4 --total-timesteps 8192"
  "dqn_atari_multigpu.py|--env-id BreakoutNoFrameskip-v4 --learning-starts 1000 --total-timesteps 4000 --log-every 200"
  "sac_continuous_action_multigpu.py|--env-id Hopper-v5 --learning-starts 1000 --total-timesteps 2600 --log-every 100"
  "td3_continuous_action_multigpu.py|--env-id Hopper-v5 --learning-starts 1000 --total-timesteps 3000 --log-every 100"
)
for c in "${configs[@]}"; do
  script=${c%%|*}; flags=${c#*|}
  for side in old new; do
    dir=$OLD; [ $side = new ] && dir=$NEW
    name=${script%.py}-$side
    rm -rf "$RESULTS/runs/$name"
    (cd "$dir" && OMP_NUM_THREADS=1 PYTHONPATH=$dir timeout 900 python cleanrl_ddp/$script $flags \
        --seed 1 --checkpoint-every 0 --runs-dir "$RESULTS/runs" --run-name "$name" > "$RESULTS/$name.log" 2>&1)
    sps=$(cd "$NEW" && PYTHONPATH=$NEW python -c "
import sys
from benchmark import throughput as tp
from benchmark.events import read_scalar_events
print(round(tp.steady_sps(read_scalar_events(sys.argv[1])[tp.SPS_TAG], 3), 1))" "$RESULTS/runs/$name" 2>&1 | tail -1)
    echo "$script $side $sps" | tee -a "$RESULTS/results.txt"
  done
done
