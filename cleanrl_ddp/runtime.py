"""Run plumbing shared by every cleanrl_ddp script, in the order a script calls it: start, load the run, sizes,
seeding, episodes, open the run, the loop's schedules, metrics, replica check and preemption vote, checkpoints, the
end, exit codes. docs/runtime.md describes it.

Plain functions and small dataclasses, called in one line where the thing happens; nothing here calls back
into a script, and the algorithm and every data-parallel decision stay in the scripts. What no script calls
lives beside it: run.py (`RunArgs` and `Run`, named here), run_dir.py (run directory and restarts), launch.py
(launcher, signals, device, threads), checkpoint.py, lease.py, errors.py (exit codes, RunError); evals.py evaluates
an agent and atari.py holds the ALE helpers.
"""

import os
import random
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist

from cleanrl_ddp import checkpoint, errors, launch, run_dir
from cleanrl_ddp.errors import EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_LOST_RANK, EXIT_OUTPUT_CLOSED, EXIT_PREEMPTED
from cleanrl_ddp.run import Run, RunArgs, check_run_flags  # the run itself, its flags: `class Args(rt.RunArgs)`

# errors.py, which imports nothing of ours, defines it; named here, so that a script's `rt.X` resolves in this file
RunError = errors.RunError  # an error the user can fix: one line from rank 0, then its exit code


# ---------------------------------------------------------------------------------------------- start
def start(args: RunArgs, script: str) -> Run:
    """Read the launcher, catch preemption signals, check the run flags, pick the device, join the process group."""
    rank, local_rank, world_size, local_world_size = launch.read_launch_env()
    run = Run(script, args, rank, world_size, torch.device("cpu"), None)
    launch.catch_signals(run)  # preemption: all ranks vote and stop together (`preempted`)
    check_run_flags(args)
    launch.check_elastic_restarts(args.run_name)
    use_cuda = args.cuda and torch.cuda.is_available()
    run.device, run.backend = launch.choose_device(
        use_cuda, args.backend, local_rank, local_world_size, args.share_gpus
    )
    if run.device.type == "cuda":
        torch.cuda.set_device(run.device)
    # Each rank gets its share of the cores it may run on (torchrun would otherwise leave 1).
    threads, why = launch.threads_per_rank(os.environ, local_world_size, launch.usable_cores())
    torch.set_num_threads(threads)
    if world_size > 1:
        timeout, device_id = timedelta(seconds=args.dist_timeout), run.device if run.backend == "nccl" else None
        dist.init_process_group(run.backend, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id)
    if run.is_main:
        backend = run.backend if world_size > 1 else "none (one process)"
        ranks = f"{world_size} rank(s) ({local_world_size} on this node)"
        threads = f"{threads} thread(s) per rank ({why})"
        print(f"{script}: {ranks}, device {run.device}, {threads}, backend {backend}", flush=True)
    return run


def load_run(run: Run, args: RunArgs, required: tuple = ()) -> tuple[Any, Optional[dict]]:
    """Name the run directory, take its lease, load the checkpoint to continue from and merge its flags with this
    command line's; returns (args, checkpoint or None). Every launch calls it: a new run loads nothing.

    Rank 0 decides (`run_dir.choose_run_dir`) and every rank learns the outcome (or the same RunError).
    """
    outcome = None
    if run.is_main:
        try:
            outcome = run_dir.choose_run_dir(run, args, required)
        except RunError as e:
            outcome = e
    outcome = broadcast_from_main(run, outcome)
    if isinstance(outcome, RunError):
        raise outcome
    run.run_dir, run.args, ckpt, run.new_dir = outcome
    run.wandb_run_id = ckpt.get("wandb_run_id") if ckpt else None
    if ckpt:
        check_run_flags(run.args)
    path = args.resume or run.run_dir
    _loading[:] = [os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path] if ckpt else []
    return run.args, ckpt


_loading: list = []
"""the checkpoint whose state the script is loading, from `load_run` to `open_run`: an error there is the file's
(another program's, or one that does not fit this script), which `exit_codes` reports in one line"""


def check_env(env_id: str, make_env, action_space: type, hint: str) -> None:
    """Raise RunError unless `make_env(env_id)()` makes an env with a Box observation space and an `action_space`.

    One line for an unknown id, a missing package or another space; `hint` (ids to try, the script for the
    other action space) ends the lines that need one. Called before anything is built.
    """
    try:
        env = make_env(env_id)()
    except gym.error.DependencyNotInstalled as e:
        raise RunError(f"--env-id {env_id} needs a missing package ({e}); try: pip install -e '.[mujoco]'") from None
    except Exception as e:  # gymnasium raises several error types for unknown or broken ids
        raise RunError(f"unknown --env-id {env_id!r} ({type(e).__name__}); {hint}") from None
    spaces = dict(observation=(env.observation_space, gym.spaces.Box), action=(env.action_space, action_space))
    env.close()
    for what, (space, wanted) in spaces.items():  # FrozenLake's Discrete, Blackjack's Tuple: not a vector
        if not isinstance(space, wanted):
            found = f"has a {type(space).__name__} {what} space"
            raise RunError(f"--env-id {env_id} {found}; this script needs a {wanted.__name__} one ({hint})")


# ---------------------------------------------------------------------------------------------- sizes
def require_at_least_1(args: RunArgs, *names: str) -> None:
    """Raise RunError naming the first flag of `names` below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise RunError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


@dataclass(frozen=True)
class Sizes:
    """The sizes a script derives (`derive_sizes`) that this module reads; each script extends it with its own."""

    world_size: int
    num_envs: int
    batch_size: int
    num_iterations: int


# ---------------------------------------------------------------------------------------------- seeds and RNG streams
def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int, *more: int) -> int:
    """A seed of rank `rank`'s own (and of `more`, e.g. an iteration), drawn from the run's `seed`: streams that no
    other rank shares, and the same seed again for the same (seed, rank, ...)."""
    return int(np.random.SeedSequence([seed, rank, *more]).generate_state(1)[0])


def resume_rng(run: Run, ckpt: dict, seed: int) -> None:
    """Every rank's RNG streams as saved; at another world size, new ones from (seed, rank, iteration).

    The saved streams belong to the old ranks: a changed world size cannot continue them, so it seeds
    streams that no earlier attempt used and that the same restart reproduces.
    """
    if ckpt["world_size"] == run.world_size:
        checkpoint.set_rng_states(ckpt["rng"][run.rank], run.device)
    else:
        seed_everything(rank_seed(seed, run.rank, ckpt["iteration"]))


# ------------------------------------------------------------------------------------ episodes and copies to the device
class Episodes:
    """Each env's running episode return and length (as gymnasium's RecordEpisodeStatistics keeps them), and the
    sums of the episodes that ended since the last `take`, by name: the metrics `all_sum` reduces and `log` logs."""

    def __init__(self, num_envs: int):
        self.returns, self.lengths = np.zeros(num_envs), np.zeros(num_envs, dtype=np.int64)
        self.sums = dict(episode_return_sum=0.0, episode_length_sum=0, episodes=0)

    def step(self, rewards, ended, stepped=1, envs=slice(None)) -> None:
        """One step of `envs` (all, or a slice): add `rewards` and `stepped` (0 where an env only reset), close
        the episodes that `ended`."""
        returns, lengths = self.returns[envs], self.lengths[envs]
        returns += rewards
        lengths += stepped
        self.sums["episode_return_sum"] += returns[ended].sum()
        self.sums["episode_length_sum"] += lengths[ended].sum()
        self.sums["episodes"] += ended.sum()
        returns[ended], lengths[ended] = 0, 0

    def take(self) -> dict:
        """The sums of the episodes ended since the last call, by name."""
        sums, self.sums = self.sums, dict.fromkeys(self.sums, 0)
        return sums


def to_device(array: np.ndarray, device: torch.device, staging: Optional[torch.Tensor] = None, dtype=None):
    """`array` on `device` (as `dtype`), from page-locked host memory on CUDA: the host never waits. Through
    `staging` (a host buffer of its shape, `pin_memory=` on CUDA): on CPU the result IS `staging` till the next
    call, on CUDA the copy may still run, so the caller waits for the device (`action.cpu()`) before that call.
    Else through a new buffer per call, which torch's caching host allocator keeps until its copy has run."""
    if staging is None:
        dtype = dtype or torch.from_numpy(array).dtype
        staging = torch.empty(array.shape, dtype=dtype, pin_memory=device.type == "cuda")
    staging.numpy()[...] = array
    return staging.to(device, non_blocking=device.type == "cuda")


class Stopwatch:
    """The wall time spent inside `with stopwatch:` blocks, summed until `take()` (e.g. the flat all-reduce's)."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        self.started = time.perf_counter()

    def __exit__(self, *_):
        self.seconds += time.perf_counter() - self.started

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


# ---------------------------------------------------------------------------------------------- open the run
def open_run(run: Run, sizes: Sizes, ckpt: Optional[dict]) -> None:
    """Check the sizes against the checkpoint, claim the run directory, open the logs, start the SPS clock."""
    run.sizes = asdict(sizes)
    run_dir.check_resumable(run, run.sizes, ckpt)
    _loading.clear()
    error = run_dir.claim_run_dir(run) if run.is_main else None
    if run.is_main and not error:
        try:
            open_logs(run, run.sizes, ckpt)
        except RunError as e:  # W&B could not start
            error = str(e)
    error = broadcast_from_main(run, error)
    if error:  # every rank stops alike
        raise RunError(error)
    run.progress.sps_window.append((time.time(), ckpt["global_step"] if ckpt else 0))


def open_logs(run: Run, sizes: dict, ckpt: Optional[dict]) -> None:
    """Rank 0: TensorBoard (and W&B with --track), and the sizes table on stdout."""
    from torch.utils.tensorboard import SummaryWriter

    args, global_step = run.args, ckpt["global_step"] if ckpt else 0
    config = {**asdict(args), **sizes}
    if args.track:
        import wandb

        # a resumed run passes the id saved in its checkpoint; a new one keeps the id W&B chose
        names = dict(project=args.wandb_project_name, entity=args.wandb_entity, name=os.path.basename(run.run_dir))
        options = dict(config=config, sync_tensorboard=True, save_code=True, resume="allow")
        try:
            run.wandb_run_id = wandb.init(**names, **options, id=run.wandb_run_id).id
        except wandb.errors.Error as e:  # not logged in, no network, ...
            reason = errors.one_line(e)
            raise RunError(f"--track: W&B could not start ({reason}); `wandb login`, or WANDB_MODE=offline") from None
    # purge_step drops events a crashed attempt logged after the checkpoint: no duplicate steps
    # (a restart before the first checkpoint purges from step 1)
    run.writer = SummaryWriter(run.run_dir, purge_step=None if run.new_dir else global_step + 1)
    _open_runs.append(run)  # closed on every way out (`close_logs`, from `exit_codes`)
    # a full disk in TensorBoard's writer thread is said once, by the next write, without the thread's traceback
    threading.excepthook = errors.quiet_writer_disk_full
    table = "\n".join(f"|{k}|{v}|" for k, v in config.items())
    run.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    print(f"{run.script}: {args.env_id}, run directory {run.run_dir}")
    for key, value in sizes.items():
        print(f"  {key:<22}{value}")
    if ckpt:
        print(f"  resuming at iteration {ckpt['iteration'] + 1}, global step {global_step}", flush=True)
    if ckpt and ckpt["world_size"] != run.world_size:
        print(
            f"  world size {ckpt['world_size']} -> {run.world_size}: global sizes kept, per-rank sizes derived "
            "again, RNG streams seeded from (seed, rank, iteration)",
            flush=True,
        )


# ------------------------------------------------------------------- the loop: schedules, metrics, replicas, preemption
def steps_crossed(prev_step: int, global_step: int, every: int) -> int:
    """How many multiples of `every` lie in (prev_step, global_step]: the schedule of periodic events.

    The global step grows by the global batch per iteration, so a period that is not a multiple of it
    is still kept on average, and every rank computes the same answer from the same global step.
    """
    return global_step // every - prev_step // every if every > 0 else 0


def all_sum(run: Run, metrics: dict) -> dict:
    """Sum named metrics over all ranks in one all-reduce (float64): a dict in, a dict of floats out."""
    values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=run.device) for v in metrics.values()])
    if run.world_size > 1:
        dist.all_reduce(values)
    return dict(zip(metrics, values.tolist(), strict=True))


def log(run: Run, global_step: int, scalars: dict, episodes: dict) -> None:
    """Rank 0: write `scalars`, the episode means and SPS, and show progress (no collective). `episodes` holds,
    by name, the sums of `Episodes.take` over all ranks (`all_sum`'s output may be passed whole)."""
    run.progress.sps_window.append((time.time() - run.progress.paused_seconds, global_step))
    (t0, s0), (t1, s1) = run.progress.sps_window[0], run.progress.sps_window[-1]
    sps = int((s1 - s0) / max(t1 - t0, 1e-9))
    if not run.is_main:
        return
    return_sum, length_sum, count = (episodes[k] for k in ("episode_return_sum", "episode_length_sum", "episodes"))
    scalars = {**scalars, "charts/episodes": count, "charts/SPS": sps}
    if count:
        scalars.update({"charts/episodic_return": return_sum / count, "charts/episodic_length": length_sum / count})
        run.progress.recent_returns.append(return_sum / count)
    for tag, value in scalars.items():
        run.writer.add_scalar(tag, value, global_step)
    total = run.args.total_timesteps
    recent = np.mean(run.progress.recent_returns) if run.progress.recent_returns else float("nan")
    line = f"step {global_step}/{total} ({100 * global_step / total:.0f}%)  SPS {sps}  return {recent:.1f}"
    run.progress.last_line = line
    if sys.stdout.isatty():  # one live line on a terminal, a line every 10 s in a log file
        print("\r" + line, end="", flush=True)
    elif time.time() - run.progress.last_print >= 10:
        run.progress.last_print, run.progress.last_line = time.time(), ""
        print(line, flush=True)


def check_replicas_in_sync(where: str, world_size: int, *objects) -> None:
    """Raise RunError (EXIT_DIVERGED) on every rank, naming the ranks, if any replica's bits differ from rank 0's."""
    if world_size == 1:
        return  # nothing to compare
    local = state_checksum(*objects)
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    bad = [r for r in range(1, world_size) if not torch.equal(gathered[r], gathered[0])]
    if bad:
        raise RunError(
            f"replicas diverged at {where}: rank(s) {bad} hold parameters, optimizer or other state that "
            "differs from rank 0's",
            EXIT_DIVERGED,
        )


def state_checksum(*objects) -> torch.Tensor:
    """A cheap fingerprint (int64 [2]) of the exact bits of modules, optimizers and tensors."""
    tensors = []
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state_dict()["state"].values():
                tensors += [v for v in state.values() if torch.is_tensor(v)]
        else:
            tensors += list(obj.state_dict().values())
    device = next((t.device for t in tensors), torch.device("cpu"))
    total = torch.zeros(2, dtype=torch.int64, device=device)
    views = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}
    views[torch.float16] = torch.int16
    for t in tensors:
        bits = t.detach().reshape(-1).to(device)
        bits = (bits.view(views[bits.dtype]) if bits.dtype in views else bits).to(torch.int64)
        total[0] += bits.sum()
        total[1] += (bits * torch.arange(1, bits.numel() + 1, device=device)).sum()
    return total


@contextmanager
def off_the_clock(run: Run):
    """Time spent inside (evaluation) does not count in SPS."""
    started = time.time()
    try:
        yield
    finally:
        run.progress.paused_seconds += time.time() - started


def broadcast_from_main(run: Run, obj):
    """Rank 0's `obj` on every rank (one collective; nothing to do with one process)."""
    if run.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def preempted(run: Run) -> bool:
    """Whether any rank has received SIGTERM/SIGUSR1: one all-reduce of the votes, so all ranks agree."""
    vote = torch.tensor([float(bool(run.signals))], device=run.device)
    if run.world_size > 1:
        dist.all_reduce(vote)
    return vote.item() > 0


# ---------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(run: Run, iteration: int, global_step: int, rank_state=None, **state) -> None:
    """Write {run dir}/checkpoint.pt atomically from rank 0, with every rank's RNG states (collective).

    `state` is the script's own, the same on every rank (agent, optimizer, ...); `rank_state` is each
    rank's own (its envs, say), saved as the list `ckpt["rank_state"]` by rank. A failed write (full
    disk, quota, read-only) stops every rank with one line; the previous checkpoint is left intact.
    """
    local = (checkpoint.rng_states(run.device), rank_state)
    gathered = [local]
    if run.world_size > 1:
        gathered = [None] * run.world_size
        dist.all_gather_object(gathered, local)
    all_rng, all_rank_state = [g[0] for g in gathered], [g[1] for g in gathered]
    error = None
    if run.is_main:
        # the events up to this checkpoint reach the disk first: a crash after it loses none
        checkpoint.sync_events(run.writer)
        ckpt = dict(script=run.script, args=asdict(run.args), sizes=run.sizes, world_size=run.world_size)
        ckpt |= dict(versions=checkpoint.library_versions())
        ckpt |= dict(iteration=iteration, global_step=global_step, rng=all_rng, rank_state=all_rank_state)
        ckpt |= dict(wandb_run_id=run.wandb_run_id, **state)
        path = os.path.join(run.run_dir, "checkpoint.pt")
        try:
            checkpoint.atomic_save(ckpt, path)
        except OSError as e:
            error = f"could not write {path} ({e.strerror}); the previous checkpoint is intact"
    error = broadcast_from_main(run, error)
    if error:
        raise RunError(error)


# ---------------------------------------------------------------------------------------------- the end and exit
def finish_or_exit_preempted(run: Run, global_step: int, preempted: bool, *envs) -> None:
    """After the loop: close `envs` and the logs; after a preemption, say where to resume and exit 75."""
    for env in envs:
        env.close()
    if run.is_main:
        print("" if sys.stdout.isatty() else run.progress.last_line, flush=True)  # end the live line, or show the last
        close_logs(EXIT_PREEMPTED if preempted else 0)
        if preempted:
            print(
                f"{run.script}: preempted by a signal at global step {global_step}; checkpoint saved in "
                f"{run.run_dir}; relaunch with --resume {run.run_dir} to continue",
                file=sys.stderr,
                flush=True,
            )
    if preempted:
        raise SystemExit(EXIT_PREEMPTED)


_open_runs: list = []  # rank 0's runs whose TensorBoard writer (and W&B run) `open_logs` opened


def close_logs(exit_code: int) -> None:
    """Flush and close rank 0's TensorBoard writer and finish its W&B run with `exit_code`; every way out of a
    run comes here (`finish_or_exit_preempted`, and `exit_codes` after an error), so the last scalars are never lost."""
    while _open_runs:
        run = _open_runs.pop()
        try:
            run.writer.close()
            if run.args.track:
                import wandb

                wandb.finish(exit_code=exit_code)
        except Exception as e:  # on the way out after another error: say it (a full disk: said), and leave anyway
            if not (exit_code == errors.EXIT_BAD_INPUT and errors.disk_full(e)):
                print(
                    f"{run.script}: could not close the logs of {run.run_dir} ({errors.one_line(e)})", file=sys.stderr
                )


@contextmanager
def exit_codes(script: str):
    """Wrap a script's `main()`: one-line errors and exit codes, process-group teardown, then leave.

    RunError: rank 0 prints `{script}: error: ...` and every rank exits with its code; so does an error while the
    script loads a checkpoint's state (`_loading`: a tensor of another shape, say), with EXIT_BAD_INPUT, and another
    rank whose own part failed (its envs) says it too (`print_run_error`). A failed collective (a lost rank): every
    surviving rank prints one line and exits with EXIT_LOST_RANK. Out of memory: as a load error (the sizes asked for
    too much).
    """
    exit_code = 1
    try:
        yield
        exit_code = 0
    except SystemExit as e:
        exit_code = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:  # a second Ctrl-C (`interrupt`), or one before the handler was installed
        exit_code = EXIT_INTERRUPTED
        if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
            print(f"\n{script}: interrupted twice: stopped at once, without a checkpoint", file=sys.stderr, flush=True)
    except BrokenPipeError:  # the reader of stdout left (`--help | head`): nothing to say, and nowhere to say it
        exit_code = EXIT_OUTPUT_CLOSED
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush below must not raise again
    except RunError as e:
        exit_code = e.code
        print_run_error(script, e)
    except Exception as e:
        reason = lost_rank_message(e)
        if reason is None and errors.out_of_memory(e):  # maybe on this rank only
            exit_code = errors.EXIT_BAD_INPUT
            text = errors.one_line(e).split("] ", 1)[-1].removeprefix("err == 0. ")  # no C++ source prefix
            message = f"ran out of memory ({text}): lower the sizes the run allocates (envs, steps, buffer, batch)"
            print_run_error(script, f"{message}; nothing was overwritten", every_rank=True)
        elif reason is None and errors.disk_full(e):  # rank 0's logs (TensorBoard raises its writer's error here)
            exit_code = errors.EXIT_BAD_INPUT
            print_run_error(
                script,
                f"no room to write ({errors.one_line(e)}); the last checkpoint, if any, is intact: make room "
                "and relaunch to resume",
            )
        elif reason is None and _loading and isinstance(e, errors.LOAD_ERRORS):
            exit_code = errors.EXIT_BAD_INPUT  # e.g. a tensor of another shape, an entry of another type
            text = errors.one_line(e)
            message = f"--resume: {_loading[0]} does not fit this script ({text}); it was left as it is"
            print_run_error(script, message, every_rank=True)  # a rank's own envs or buffer may be what failed
        elif reason is None:
            import traceback

            traceback.print_exc()
        else:  # the other ranks cannot be told, so every surviving rank says it, in one line
            exit_code = EXIT_LOST_RANK
            rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))
            print(
                f"{script}: error: rank {rank} lost contact with the other ranks ({reason}): a rank died, stalled "
                "longer than --dist-timeout, or the network failed; relaunch to resume from the last checkpoint",
                file=sys.stderr,
                flush=True,
            )
    finally:
        close_logs(exit_code)
        if dist.is_initialized() and exit_code != EXIT_LOST_RANK:  # teardown could wait on the lost peers
            dist.destroy_process_group()
        # Leave without interpreter finalization: there, gloo's C++ threads can still call std::terminate
        # ("terminate called without an active exception", pytorch#179291) and turn a finished run, or the
        # one-line exit 4 of a lost rank, into SIGABRT. Logs and checkpoints are closed and flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


RANK_0_FIRST_S = 5.0
"""how long another rank waits for rank 0 to report the same error first (then torchrun stops the others)"""


def print_run_error(script: str, error, every_rank: bool = False) -> None:
    """Rank 0 prints `{script}: error: {error}`. The other ranks say nothing, or, `every_rank`, say it as `rank r:`
    unless rank 0 said it first: an error of what only this rank loaded (its envs, its buffer)."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    if rank == 0:
        print(f"{script}: error: {error}", file=sys.stderr, flush=True)
    elif every_rank or not dist.is_initialized():
        # Let rank 0 (maybe still starting up) print the error every rank found first: torchrun stops the other
        # ranks as soon as one exits. Rank 0 meanwhile waiting in a collective did not find it.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(RANK_0_FIRST_S)
        if every_rank:
            print(f"{script}: error: rank {rank}: {error}", file=sys.stderr, flush=True)


def lost_rank_message(e: BaseException) -> Optional[str]:
    """The reason, if `e` is what a collective raises when a peer died or stalled past the timeout, else None."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if not (isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo" in text.lower())):
        return None
    return text.split("] ", 1)[-1].split(". This is typically", 1)[0][:160]  # drop the C++ source prefix
