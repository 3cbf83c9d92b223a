"""The run's flags and the run itself, which runtime.py and run_dir.py both use: `RunArgs` (the flags every script's
`Args` extends) with their checks, and `Run` (who this process is in the job, where the run writes). It imports
nothing of ours but errors.py, so both can import it without a cycle; scripts reach it as `rt.RunArgs`.
"""

import math
import types
import typing
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch

from cleanrl_ddp.errors import RunError


@dataclass
class RunArgs:
    """The flags of the run plumbing and of evaluation, and the script flags they read; every script's `Args`
    extends this with its algorithm's flags (and its own `exp_name`, `env_id`, `total_timesteps`, `eval_greedy`).
    Every periodic flag (`--eval-every`, `--sync-check-every`, `--checkpoint-every`) counts global steps, the env
    steps of all ranks together, as --total-timesteps does; the loop tests it with `runtime.steps_crossed`."""

    exp_name: str = ""
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment; rank r's envs and random streams are derived from it"""
    env_id: str = ""
    """the id of the environment"""
    total_timesteps: int = 0
    """env steps of the whole run, summed over all ranks"""
    cuda: bool = True
    """if toggled and CUDA is available, train on `cuda:{local_rank}`"""
    track: bool = False
    """if toggled, log to Weights and Biases (one run per job, from rank 0)"""
    wandb_project_name: str = "cleanrl_ddp"
    """the W&B project name"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team)"""
    runs_dir: str = "runs"
    """the directory that holds one sub-directory per run (TensorBoard events, checkpoint.pt, videos)"""
    run_name: Optional[str] = None
    """the run's directory name; default `{UTC start}__{env_id}__{exp_name}__{seed}__{launch id}`, kept by restarts"""
    eval_every: int = 0
    """run evaluation episodes on rank 0 every N global steps (0 = never)"""
    eval_greedy: bool = True
    """if toggled, evaluation acts greedily (each script says how); --no-eval-greedy samples"""
    eval_episodes: int = 10
    """episodes per evaluation, played in parallel in rank 0's separate evaluation envs"""
    target_return: Optional[float] = None
    """stop every rank (after a checkpoint) once an evaluation's mean return reaches this"""
    capture_video: bool = False
    """record each evaluation's first episode to {run dir}/videos and TensorBoard/W&B (needs the video extra)"""
    backend: Optional[Literal["nccl", "gloo"]] = None
    """the torch.distributed backend; default NCCL on CUDA, gloo on CPU (gloo also lets ranks share a GPU)"""
    dist_timeout: float = 300.0
    """seconds a collective may wait for a missing or stalled rank before the job fails"""
    share_gpus: bool = False
    """with NCCL, allow more ranks per node than visible GPUs (e.g. srun --gpus-per-task=1: each sees its own)"""
    sync_check_every: int = 0
    """every N global steps, compare the ranks' weights and optimizer state (0 = off)"""
    checkpoint_every: int = 100000
    """write checkpoint.pt every N global steps (0 = only at the end, at a stop and on preemption)"""
    resume: Optional[str] = None
    """continue from a run directory or a checkpoint.pt file (its flags are the defaults; flags given here win)"""


MAX_DIST_TIMEOUT = 365 * 86400
"""the longest --dist-timeout (a year): torch.distributed keeps its timeout in milliseconds"""


IN_RANGE = {
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "finite and at least 0": lambda v: 0 <= v < math.inf,
    "at least 0 (inf: no limit)": lambda v: v >= 0,
    "positive": lambda v: v > 0,
    "a number": lambda v: not math.isnan(v),
}
UNIT, FINITE, LIMIT = "in [0, 1]", "finite and at least 0", "at least 0 (inf: no limit)"
FLAG_RANGES = dict.fromkeys(("gamma", "gae_lambda", "q_lambda", "tau", "start_e", "end_e", "eval_epsilon"), UNIT)
FLAG_RANGES |= dict.fromkeys(("repeat_action_probability",), UNIT)
FLAG_RANGES |= dict.fromkeys(("learning_rate", "q_lr", "policy_lr", "alpha", "ent_coef", "vf_coef"), FINITE)
FLAG_RANGES |= dict.fromkeys(("exploration_noise", "policy_noise", "noise_clip"), FINITE)
FLAG_RANGES |= dict.fromkeys(("clip_coef", "max_grad_norm", "clip_obs", "clip_reward", "target_kl"), LIMIT)
FLAG_RANGES |= dict(exploration_fraction="positive")
"""the scripts' float flags that have a range (`IN_RANGE`): discounts, trace decays, the target networks' update mix
and probabilities; step sizes, loss coefficients and noise scales; clips and limits. Any other: not NaN"""


def fits(value, hint) -> bool:
    """Whether `value` (a checkpoint's saved flag: data someone else may have written) is of the flag's type `hint`."""
    if typing.get_origin(hint) is Literal:
        return value in typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # Optional[...]
        return any(fits(value, option) for option in typing.get_args(hint))
    kinds = {float: (int, float), type(None): type(None)}.get(hint, typing.get_origin(hint) or hint)  # list[str]: list
    return isinstance(value, kinds) and (hint is bool or not isinstance(value, bool))


def misfit_flags(saved: dict, cls) -> list:
    """The entries of `saved` (a checkpoint's flags) of another type than the field of `cls` they name, as text."""
    hints = typing.get_type_hints(cls)
    return [f"{k} ({v!r})" for k, v in saved.items() if k in hints and not fits(v, hints[k])]


def check_values(args) -> None:
    """Raise RunError for a float flag of `args` out of its range (`FLAG_RANGES`) or a --seed that numpy cannot
    take: either would fail deep in torch or numpy, or train on NaN, later."""
    if not 0 <= args.seed < 2**32:
        raise RunError(f"--seed must be in [0, 2**32 - 1], got {args.seed}")
    for name, value in vars(args).items():
        must = FLAG_RANGES.get(name, "a number")
        if isinstance(value, float) and not IN_RANGE[must](value):
            raise RunError(f"--{name.replace('_', '-')} must be {must}, got {value}")


def check_run_flags(args: RunArgs) -> None:
    """Raise RunError for flags that are out of range (`check_values`) or that need another flag."""
    check_values(args)
    for name in ("checkpoint_every", "sync_check_every", "eval_every"):
        if getattr(args, name) < 0:
            raise RunError(f"--{name.replace('_', '-')} must be 0 (off) or positive")
    if args.eval_episodes < 1:
        raise RunError(f"--eval-episodes must be at least 1, got {args.eval_episodes}")
    if args.target_return is not None and not args.eval_every:
        raise RunError("--target-return needs --eval-every N (the evaluation decides the stop)")
    if args.capture_video and not args.eval_every:
        raise RunError("--capture-video needs --eval-every N (videos are of the evaluation episodes)")
    if args.capture_video:
        try:
            import moviepy  # noqa: F401 (gymnasium's RecordVideo and TensorBoard's add_video use it)
        except ImportError:
            raise RunError("--capture-video needs moviepy: pip install -e '.[video]'") from None
    if not 0 < args.dist_timeout <= MAX_DIST_TIMEOUT:  # inf overflows the process group's timeout
        raise RunError(
            f"--dist-timeout must be positive (seconds) and at most {MAX_DIST_TIMEOUT}, got {args.dist_timeout}"
        )


@dataclass
class Progress:
    """Rank 0's progress line: the SPS clock (evaluation time excluded), the recent returns, what was printed when."""

    sps_window: deque = field(default_factory=lambda: deque(maxlen=11))
    paused_seconds: float = 0.0  # evaluation time, excluded from SPS
    recent_returns: deque = field(default_factory=lambda: deque(maxlen=100))
    last_print: float = 0.0
    last_line: str = ""  # the newest progress line, not yet printed to a log file


@dataclass
class Run:
    """Who this process is in the job, and where the run writes. Made by `runtime.start`, filled in by
    `runtime.load_run` and `runtime.open_run`."""

    script: str
    args: Any
    rank: int
    world_size: int
    device: torch.device
    backend: Optional[str]
    signals: list = field(default_factory=list)  # preemption signals received, appended by the handler
    run_dir: str = ""
    new_dir: bool = False  # `run_dir.claim_run_dir` creates the run directory, exclusively (a new run, not a restart)
    sizes: dict = field(default_factory=dict)  # the script's `Sizes`, as data
    writer: Any = None
    wandb_run_id: Optional[str] = None
    progress: Progress = field(default_factory=Progress)
    launch_id: str = ""  # this launch's id (`launch.launch_id`), set by `load_run` on rank 0: the lease names it

    @property
    def is_main(self) -> bool:
        return self.rank == 0  # the GLOBAL rank: one writer per job, across nodes

    @property
    def on_cuda(self) -> bool:
        """On CUDA: host buffers page-locked (`pin_memory=`), their copies `non_blocking=`; a value, not a branch."""
        return self.device.type == "cuda"
