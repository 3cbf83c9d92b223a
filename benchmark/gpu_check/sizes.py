"""What each check runs, as data: the script table (one row per script of cleanrl_ddp/ for each check that runs
scripts one by one) and the sizes of every check on a GPU (`GPU`) and on the CPU at tiny sizes (`CPU`).

A script added to cleanrl_ddp/ gets a row in each table (`FEW_ITERATIONS`, `Sizes.graphs`, `Sizes.graphs_speed`);
without one its check fails and says so, and a CPU test checks that every script has its rows.
"""

import dataclasses
import importlib
import importlib.util
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ATARI = "ppo_atari_multigpu.py"
ASYNC = "ppo_atari_async_multigpu.py"
PPO = "ppo_multigpu.py"
CONTINUOUS = "ppo_continuous_action_multigpu.py"
PQN = "pqn_multigpu.py"
PQN_ATARI = "pqn_atari_multigpu.py"
DQN = "dqn_atari_multigpu.py"
SAC = "sac_continuous_action_multigpu.py"
TD3 = "td3_continuous_action_multigpu.py"
OFF_POLICY = (SAC, TD3)
ENV_ID = "BreakoutNoFrameskip-v4"
NEEDS = {CONTINUOUS: "mujoco"}  # a module beyond `pip install -e .`: its checks are skipped without it
COMPILED = (ATARI, SAC, TD3)  # the scripts with --compile

# The few-iteration run of each script at world size 1 (`script:`, `sync-debug:`; twice as long on 2 ranks for
# `gloo:`, `flat:`, `compile:`): its flags and the global step it must end at. The PPO and PQN scripts: 3 iterations
# of 4 envs x 32 steps, 4 minibatch updates each.
PPO_FEW = "--local-num-envs 4 --num-steps 32 --num-minibatches 2 --update-epochs 2"
FEW_ITERATIONS = dict.fromkeys((PPO, ATARI, ASYNC, PQN, PQN_ATARI), (PPO_FEW, 3 * 4 * 32)) | {
    CONTINUOUS: ("--num-steps 64 --num-minibatches 2 --update-epochs 2", 3 * 64),
    # updates from global step 64, one every 4 (48 of them), the target network synced every 64
    DQN: (
        "--local-num-envs 4 --buffer-size 512 --learning-starts 64 --train-frequency 4 --local-batch-size 32 "
        "--target-network-frequency 64 --log-every 64",
        256,
    ),
    # Pendulum-v1 (no MuJoCo needed), 1 env: updates from global step 64, one per step (192; TD3's actor and both
    # target networks after every 2nd)
    **dict.fromkeys(
        OFF_POLICY,
        ("--env-id Pendulum-v1 --buffer-size 512 --learning-starts 64 --local-batch-size 32 --log-every 64", 256),
    ),
}


@dataclasses.dataclass(frozen=True)
class Graphs:
    """`graphs:<script>`: the runs whose final checkpoints must be bitwise equal with --cudagraphs and without."""

    flags: str  # every run's flags (the scripts' default learning rates: both paths read a float32 tensor)
    total: int  # the global step of the runs at world size 1; the --cudagraphs one's checkpoint is trained on to twice
    ranks2: tuple = ()  # --grad-sync of each pair at 2 ranks sharing the device; the first's eager run is the reference
    total2: int = 0  # the global step of the 2-rank runs


@dataclasses.dataclass(frozen=True)
class Speed:
    """A speed row at world size 1 (`graphs-speed:`, `compile-speed:`): runs one after another, steady SPS each."""

    flags: str  # with --total-timesteps
    total: int  # the global step every run must end at
    warmup: int  # the logged SPS points left out: start-up, random actions, the capture or compile
    more: tuple = ()  # graphs-speed: variants beyond --no-cudagraphs and --cudagraphs


PPO_GRAPHS = PPO_FEW  # 8 iterations
PPO_GRAPHS_CPU = "--local-num-envs 1 --num-steps 4 --num-minibatches 1 --update-epochs 1"
DQN_GRAPHS = "--buffer-size 512 --learning-starts 64 --train-frequency 4 --target-network-frequency 64 --log-every 64"
# SAC and TD3: Pendulum-v1, updates from step 200 (32 on the CPU): 400 critic updates at world size 1, 300 at 2 ranks
OFF_GRAPHS = "--env-id Pendulum-v1 --learning-starts 200 --local-batch-size 64 --log-every 100"
OFF_GRAPHS_CPU = "--env-id Pendulum-v1 --learning-starts 32 --local-batch-size 16 --log-every 16"
PPO_SPEED = Speed("--local-num-envs 8 --num-steps 128 --total-timesteps 20480", 20480, 4)  # 20 iterations
OFF_SPEED = "--env-id HalfCheetah-v5 --learning-starts 1000 --total-timesteps 3000 --log-every 250"  # from the 6th
PPO_SPEED_CPU = Speed(
    "--local-num-envs 1 --num-steps 8 --num-minibatches 1 --update-epochs 1 --total-timesteps 32", 32, 1
)
OFF_SPEED_CPU = "--env-id Pendulum-v1 --learning-starts 32 --local-batch-size 16 --total-timesteps 80 --log-every 8"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of the checks on one device: the one on a GPU, a tiny one for the CPU test."""

    graphs: dict  # script -> Graphs: every script; a script without --cudagraphs is a skip line
    graphs_speed: dict  # script -> Speed: every script, --no-cudagraphs against --cudagraphs
    compile_speed: dict  # script -> Speed: the default path against --compile (`--full`)
    resume_flags: str  # the 2-rank Atari PPO run that SIGTERM stops
    resume_iterations: int  # long enough that the signal lands before the end
    throughput_envs: tuple  # envs of the one rank measured
    throughput_iterations: int
    throughput_warmup: int
    throughput_num_steps: int
    ceiling_steps: int
    profile_iterations: int  # benchmark/profile_rollout.py's iterations at the first env count, after one warm-up
    offpolicy_profile: tuple  # profile:<SAC or TD3>: env, env steps with updates before the profiled ones, profiled
    timeouts: dict  # check kind -> seconds one of its commands may take (then it is killed and fails)
    cleanrl_iterations: int  # CleanRL's script at the first throughput env count, steady after throughput_warmup
    leanrl_iterations: int  # LeanRL's prints its speed every 10 iterations after 3 of burn-in: the last is read
    env_sweep_steps: int  # agent steps timed per setting of `env-sweep:<envs>` (benchmark/throughput.py --env-sweep)


# On a GPU. The Atari PPO's throughput 10 iterations, steady after 3 (7 iterations timed, 3.4 s at 2,100 SPS and 8
# envs); the env-only ceiling 500 vector steps (0.9 s at 4,400 steps/s and 8 envs); CleanRL's script 8 iterations
# (5 timed, 9 s at 545 SPS); LeanRL's 20 (the last 10 timed). Each time limit is a few times the check's seconds on
# an H200 (plan.ESTIMATES), so that a hang costs minutes.
GPU = Sizes(
    graphs=dict.fromkeys((PPO, ASYNC, PQN, PQN_ATARI), Graphs(PPO_GRAPHS, 8 * 4 * 32))
    | {
        ATARI: Graphs(PPO_GRAPHS, 8 * 4 * 32, ("ddp", "flat"), 2 * 8 * 4 * 32),
        CONTINUOUS: Graphs("--num-steps 64 --num-minibatches 2 --update-epochs 2", 512),
        DQN: Graphs(f"--local-num-envs 4 --local-batch-size 32 {DQN_GRAPHS}", 512),
    }
    | dict.fromkeys(OFF_POLICY, Graphs(OFF_GRAPHS, 600, ("flat",), 800)),
    graphs_speed=dict.fromkeys((PPO, ATARI, ASYNC, PQN, PQN_ATARI), PPO_SPEED)
    | {
        CONTINUOUS: Speed("--num-steps 2048 --total-timesteps 20480", 20480, 3),
        DQN: Speed(
            "--local-num-envs 8 --buffer-size 20000 --learning-starts 2000 --total-timesteps 12000 --log-every 1000",
            12000,
            4,
        ),
    }
    | dict.fromkeys(OFF_POLICY, Speed(OFF_SPEED, 3000, 6, ("--cudagraphs --compile",))),
    compile_speed={ATARI: PPO_SPEED}
    | dict.fromkeys(
        OFF_POLICY, Speed("--env-id Pendulum-v1 --learning-starts 500 --total-timesteps 3000 --log-every 250", 3000, 4)
    ),
    resume_flags="--local-num-envs 4 --num-steps 32 --num-minibatches 2 --update-epochs 1",
    resume_iterations=24,
    throughput_envs=(8, 64),
    throughput_iterations=10,
    throughput_warmup=3,
    throughput_num_steps=128,
    ceiling_steps=500,
    profile_iterations=3,
    offpolicy_profile=("HalfCheetah-v5", 50, 500),
    timeouts={"script": 90, "gloo": 90, "flat": 90, "compile": 240, "compile-flat": 240, "compile-speed": 240}
    | {"nccl-1": 60, "sync-debug": 120, "nccl-guard": 60, "resume": 120, "evaluate": 90, "throughput": 180}
    | {"async": 180}
    | {"cleanrl": 180, "leanrl": 300, "env-sweep": 360, "profile": 120, "graphs-speed": 240}
    | {"graphs": 240},  # a graphs: step: its runs at once, then 2 resumes
    cleanrl_iterations=8,
    leanrl_iterations=20,
    env_sweep_steps=4000,
)
CPU = Sizes(
    # graphs: at world size 1 (the 2-rank runs on a GPU: tests/dist_worker.py's unit launch compares the Atari PPO's
    # 2-rank --cudagraphs runs with eager ones on the CPU, and runs SAC's and TD3's with --grad-sync flat)
    graphs=dict.fromkeys((PPO, ATARI, PQN, PQN_ATARI), Graphs(PPO_GRAPHS_CPU, 8 * 1 * 4))
    | {
        ASYNC: Graphs(PPO_GRAPHS_CPU.replace("envs 1", "envs 2"), 8 * 2 * 4),
        CONTINUOUS: Graphs("--num-steps 8 --num-minibatches 1 --update-epochs 1", 64),
        DQN: Graphs(f"--local-num-envs 1 --local-batch-size 4 {DQN_GRAPHS}", 192),
    }
    | dict.fromkeys(OFF_POLICY, Graphs(OFF_GRAPHS_CPU, 48)),
    graphs_speed=dict.fromkeys((PPO, ATARI, ASYNC, PQN, PQN_ATARI), PPO_SPEED_CPU)
    | {
        CONTINUOUS: Speed("--num-steps 32 --num-minibatches 1 --update-epochs 1 --total-timesteps 96", 96, 1),
        DQN: Speed(
            "--local-num-envs 2 --buffer-size 256 --learning-starts 32 --total-timesteps 96 --log-every 16", 96, 3
        ),
    }
    | dict.fromkeys(OFF_POLICY, Speed(OFF_SPEED_CPU, 80, 6)),
    compile_speed={ATARI: Speed("--local-num-envs 2 --num-steps 16 --total-timesteps 192", 192, 1)}
    | dict.fromkeys(
        OFF_POLICY, Speed("--env-id Pendulum-v1 --learning-starts 64 --total-timesteps 256 --log-every 32", 256, 2)
    ),
    resume_flags="--local-num-envs 1 --num-steps 16 --num-minibatches 1 --update-epochs 1",
    resume_iterations=6,
    throughput_envs=(2,),
    throughput_iterations=3,
    throughput_warmup=1,
    throughput_num_steps=16,
    ceiling_steps=20,
    profile_iterations=1,
    offpolicy_profile=("Pendulum-v1", 2, 5),
    timeouts=dict.fromkeys(GPU.timeouts, 400),  # a busy 2-core CI machine
    cleanrl_iterations=3,
    leanrl_iterations=20,
    env_sweep_steps=64,
)


def scripts() -> list[str]:
    """Every script of the package: the files the checks run at world size 1."""
    return sorted(p.name for p in (REPO / "cleanrl_ddp").glob("*_multigpu.py"))


def has_flag(script: str, field: str) -> bool:
    """Whether the script's `Args` has `field` (`cudagraphs`: the flags --cudagraphs and --no-cudagraphs), inherited
    fields included. Imported: a script runs nothing at import."""
    module = importlib.import_module(f"cleanrl_ddp.{script.removesuffix('.py')}")
    return field in {f.name for f in dataclasses.fields(module.Args)}


def missing(script: str) -> str:
    """Why `script` cannot run here (a module beyond `pip install -e .`), or "" when it can."""
    module = NEEDS.get(script)
    return (
        f"needs {module} (pip install -e '.[{module}]')" if module and importlib.util.find_spec(module) is None else ""
    )


def flag(flags: str, name: str) -> str:
    """The value of `name` in `flags` ("" when absent)."""
    words = shlex.split(flags)
    return words[words.index(name) + 1] if name in words else ""


def local_steps(flags: str) -> int:
    """Env steps per rank per iteration of a PPO script's flags."""
    return int(flag(flags, "--local-num-envs")) * int(flag(flags, "--num-steps"))
