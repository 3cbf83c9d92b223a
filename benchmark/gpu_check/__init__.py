"""Check every CUDA path of the scripts on a GPU machine: one line per check (`ok`/`FAIL`/`skip`, its figure, its
seconds), each written to OUT/summary.txt the moment the check ends.

    python -m benchmark.gpu_check --out /tmp/gpu     # the quick profile: within --budget (360 s) on one H200
    python -m benchmark.gpu_check --full --out DIR    # every check (about 20-30 minutes)
    python -m benchmark.gpu_check --full --only resume evaluate --out DIR               # some checks again
    python -m benchmark.gpu_check --cleanrl-script benchmark/peers/cleanrl_ppo_atari_multigpu.py \
        --leanrl-script benchmark/peers/leanrl_ppo_atari.py   # + CleanRL's and LeanRL's (benchmark/offline_wheels.sh)
    python -m benchmark.gpu_check --device cpu --out DIR   # the same checks on the CPU at tiny sizes (its CPU test)

The quick profile (the default) answers, in one command that fits a short GPU job, whether every script works
and is fast on a GPU, the most important answers first. Its steps run one after another; the checks of one step
run at the same time (they check correctness, not speed) with one thread a process, and a speed measurement always
has the machine alone:
1. `script:<name>`: every `cleanrl_ddp/*_multigpu.py` at world size 1 for a few iterations (`FEW_ITERATIONS`);
   exit 0, its start line names the device, and its final checkpoint is at the requested global step;
2. `throughput`: the Atari PPO with no speed flags (the default path, named in the line) at 8 and 64 envs next to
   the env-only ceiling of the same command (benchmark/throughput.py), with the update's share of the time; at 8
   envs, where one iteration's time goes (benchmark/profile_rollout.py), CleanRL's own script (`--cleanrl-script`),
   LeanRL's (`--leanrl-script`) and the asynchronous Atari PPO against the synchronous ceiling (`async`);
3. `graphs:` for the Atari PPO, SAC and TD3 (--cudagraphs bitwise equal to --no-cudagraphs, trained on with and
   without it, on 2 ranks too), `gloo:`/`flat:` for the Atari PPO and SAC (2 ranks sharing the GPU through gloo, DDP and
   `--grad-sync flat`, replicas compared every iteration), `nccl-1` (an NCCL process group at world size 1: the
   collectives the scripts make), `sync-debug:` for the Atari PPO (its synchronizing CUDA operations, counted),
   `compile:` for the Atari PPO (2 ranks, DDP, `--compile`; torch's log of a graph run without CUDA graphs fails a
   compiled check), `resume` (a 2-rank run stopped by SIGTERM, resumed at world size 1 to its exact step) and
   `evaluate` (a checkpoint trained on the device, on the device and on the CPU);
4. where the budget has room: `graphs-speed:` for the Atari PPO (--no-cudagraphs against --cudagraphs), then
   `env-sweep:8` (ALE's threads and batch size, env only), then `graphs-speed:` and `profile:` for SAC and TD3.
A check starts only if its estimated seconds on one H200 (`plan.ESTIMATES`) end within `--budget` (default 360 s for
the quick profile on CUDA), else it is a `skip` line that says so. `--full` runs every check one at a time, with no
budget: `script:`, `gloo:`, `flat:`, `graphs:`, `graphs-speed:` and `sync-debug:` for every script,
`compile:`/`compile-flat:` for the three scripts with `--compile` and `compile-speed:` (the default path against
`--compile`), `nccl-guard` (NCCL with 2 ranks on one GPU stops before init with one line), `env-sweep:64`, and for
SAC and TD3 `profile:` and `leanrl:` (LeanRL's own script beside ours, `--leanrl-sac-script`, `--leanrl-td3-script`).
docs/gpu.md says what each check means, and the budget's table.

The package: `sizes` (the script table and every check's sizes, by device), `plan` (the profiles and the budget's
estimates), `runner` (processes, the summary, the steps), `correctness` (the checks that the CUDA paths run and
match), `speed` (the speed rows), `cli` (the flags and `main`).

Results survive a kill: each check's output goes to OUT/logs/<check>.log while it runs, and its line is appended
to OUT/summary.txt as soon as it ends. A check past its time limit is killed with every process it started
(torchrun's ranks too, which run in sessions of their own: every process carries the marker GPU_CHECK_RUN in its
environment) and fails saying so. SIGTERM, SIGINT or SIGHUP to gpu_check kills every process it started, writes
which checks were unfinished to the summary, and exits 128 + the signal's number.

Without CUDA (and without `--device cpu`) it says so in one line and exits 0. Exit 1 when a check failed,
2 on bad flags.
"""
