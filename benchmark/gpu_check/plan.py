"""Which checks run, in which steps, and what each costs: the quick profile, which fits 6 minutes on one H200 with
the most important answers first, and `--full`, every check one at a time.

`ESTIMATES` holds each check's seconds on one H200 (by name, else by kind), from the quick profiles of 2026-11-26
(docs/gpu.md has the table with the source of each); `--budget` (360 s for the quick profile on CUDA)
starts a check only if its estimate ends within the budget, and a check that would not is a `skip` line saying so.
"""

from benchmark.gpu_check.sizes import ATARI, COMPILED, GPU, OFF_POLICY, SAC, TD3, scripts

QUICK_BUDGET = 360  # seconds: the quick profile's default --budget on CUDA

# Measured on an H200 unless said. Steps 1-3 of the quick profile: 26 + 195 + 100 = 321 s, then graphs-speed: of the
# Atari PPO (33 s) within 360; the rows after it run where the steps before them beat their estimates.
ESTIMATES = {
    "script": 26,  # 20-26 s each, 9 at once (9 s alone)
    "throughput": 230,  # 35 s (8 envs) + 35 (profile) + 23 (CleanRL) + 53 (LeanRL) + 49 (64 envs); async: not yet
    f"graphs:{ATARI}": 100,  # 6 runs at once, then 2 resumes: 146 s beside 12 checks at 16 threads a process
    # SAC's and TD3's: 4 runs at once took 62-63 s; then two resumes of 600 more steps (one start-up each, beside
    # the 2-rank runs; not measured yet): about 25 s more
    "graphs": 90,
    "gloo": 40,  # 31 s (Atari PPO) and 39 s (SAC), beside the other checks of the step
    "flat": 40,  # 37 and 40 s
    "compile": 74,  # the compiled 2-rank Atari PPO: 60 s, 74 s beside 10 checks at 16 threads a process
    "nccl-1": 17,
    "sync-debug": 25,
    "resume": 76,  # 76 s beside 10 checks at 16 threads a process (69 s with 60 iterations, 24 now)
    "evaluate": 25,  # 13 s on cuda + 5 s on the CPU (one thread)
    f"graphs-speed:{ATARI}": 33,  # --no-cudagraphs and --cudagraphs at 8 envs
    f"graphs-speed:{SAC}": 64,  # HalfCheetah-v5: --no-cudagraphs, --cudagraphs, --cudagraphs --compile
    f"graphs-speed:{TD3}": 49,
    "profile": 28,  # one off-policy env step timed part by part, eager and --cudagraphs: 16 + 12 s (TD3 12 + 11)
    "leanrl": 110,  # LeanRL's SAC or TD3 with --compile --cudagraphs (not measured yet: its compile) and ours
    "env-sweep:8": 26,  # 8 settings of 4,000 agent steps at 3,000-6,000 steps/s, and a process start
    "env-sweep:64": 180,  # 10 settings at 64 envs, each with 64 envs to build: unfinished after 130 s
    f"compile-speed:{ATARI}": 56,
    f"compile-speed:{SAC}": 85,
    "nccl-guard": 8,
}


def estimate(name: str) -> float:
    """A check's estimated seconds on one H200 (ESTIMATES, by name, else by kind; 60 when neither is known)."""
    return ESTIMATES.get(name, ESTIMATES.get(name.partition(":")[0], 60))


def quick_profile() -> list[list[str]]:
    """The steps of the quick profile, most important first; the checks of a step run at the same time (correctness
    checks: they may share the GPU), a speed measurement has the machine alone (a step of its own)."""
    return [
        # does every script run on the GPU?
        [f"script:{s}" for s in [ATARI, *[s for s in scripts() if s != ATARI]]],
        # how fast is the default path, next to the env's ceiling, CleanRL's and LeanRL's scripts?
        ["throughput"],
        # does every CUDA path match? (the other scripts' graphs:, gloo:, flat: in --full)
        [f"graphs:{ATARI}", f"gloo:{ATARI}", f"flat:{ATARI}", f"gloo:{SAC}", f"flat:{SAC}", "nccl-1"]
        + [f"sync-debug:{ATARI}", f"compile:{ATARI}", "resume", "evaluate", f"graphs:{SAC}", f"graphs:{TD3}"],
        # where time is left
        [f"graphs-speed:{ATARI}"],
        ["env-sweep:8"],
        *([f"graphs-speed:{s}"] for s in OFF_POLICY),
        *([f"profile:{s}"] for s in OFF_POLICY),
    ]


def full_profile() -> list[list[str]]:
    """Every check, one at a time."""
    names = [f"{kind}:{s}" for kind in ("script", "gloo", "flat", "graphs") for s in scripts()]
    names += [f"{kind}:{s}" for s in COMPILED for kind in ("compile", "compile-flat")]
    names += [f"sync-debug:{s}" for s in scripts()] + ["nccl-1"]
    names += [f"compile-speed:{s}" for s in GPU.compile_speed] + ["nccl-guard", "resume", "evaluate", "throughput"]
    names += [f"graphs-speed:{s}" for s in scripts()]
    names += [f"{kind}:{s}" for kind in ("profile", "leanrl") for s in OFF_POLICY]
    names += [f"env-sweep:{n}" for n in GPU.throughput_envs]
    return [[name] for name in names]
