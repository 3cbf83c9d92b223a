"""Evaluate a trained run: load its checkpoint with the script's own Agent and evaluation, print mean ± std.

    python -m cleanrl_ddp.evaluate runs/20261125T081500Z__CartPole-v1__ppo_multigpu__1__b68db908 --episodes 10
    python -m cleanrl_ddp.evaluate runs/.../checkpoint.pt --sample --capture-video

The checkpoint is loaded as data only (no code in it runs; a pickled file is refused). Its "script" key must
name a script module of this package (cleanrl_ddp/<script>.py); the script's `load_agent(ckpt, device)` rebuilds
its agent, which plays with the script's `make_env` and `eval_action` in cleanrl_ddp/evals.py, as in training,
with the run's own `Args`. Atari episodes are whole games (all lives), scored with the game's own points. DQN
and PQN play epsilon-greedily: `--greedy` is epsilon 0, `--sample` the run's `--eval-epsilon` (PQN: `--end-e`);
TD3's actor is deterministic: `--sample` adds the run's `--exploration-noise`. Nothing is written into the run
that is read: videos (`--capture-video`, needs `pip install -e ".[video]"`) go to `--out-dir` (default: a new directory
`evaluate-<run>-step<N>` under the working directory), never over an existing file, and into the run's TensorBoard
events only with `--log-to-run`. Bad input ends with one line `evaluate: error: ...` and exit code 2.
"""

import argparse
import importlib
import os
import re
import sys
from dataclasses import fields

import numpy as np
import torch

from cleanrl_ddp import atari, evals
from cleanrl_ddp.checkpoint import check_saved_env_id, read_checkpoint
from cleanrl_ddp.errors import EXIT_BAD_INPUT, LOAD_ERRORS, RunError, one_line
from cleanrl_ddp.run import misfit_flags

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class EvalError(Exception):
    """A problem with the user's input, printed as one line."""


def package_scripts() -> set:
    """The training scripts of this package: the modules `cleanrl_ddp/<name>_multigpu.py` present here."""
    return {name[:-3] for name in os.listdir(PACKAGE_DIR) if re.fullmatch(r"[a-z0-9_]+_multigpu\.py", name)}


def load(path: str) -> tuple[dict, str]:
    """The checkpoint at `path` (a run directory or a checkpoint file) and its run directory."""
    if os.path.isdir(path):
        path = os.path.join(path, "checkpoint.pt")
    if not os.path.isfile(path):
        raise EvalError(f"no checkpoint at {path}")
    try:
        ckpt = read_checkpoint(path)
    except RunError as e:
        raise EvalError(str(e)) from None
    script = ckpt.get("script") if isinstance(ckpt, dict) else None
    if not isinstance(script, str) or not script.endswith("_multigpu"):
        raise EvalError(f"{path} is not a checkpoint of a cleanrl_ddp script (script: {script!r})")
    if script not in package_scripts():  # a name, never a path: "../x_multigpu" is refused
        raise EvalError(f"{path} was written by {script!r}, which is not a script of this cleanrl_ddp")
    return ckpt, os.path.dirname(os.path.abspath(path))


def new_out_dir(run_dir: str, global_step: int) -> str:
    """A directory under the working directory that no earlier evaluation used."""
    base = f"evaluate-{os.path.basename(run_dir)}-step{global_step}"
    for n in range(1, 1000):
        candidate = base if n == 1 else f"{base}-{n}"
        if not os.path.lexists(candidate):
            return candidate
    raise EvalError(f"{base}-1 ... {base}-999 all exist: pass --out-dir")


def choose_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise EvalError(f"--device {name!r} is not a torch device; try cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvalError(f"--device {name}: CUDA is not available here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise EvalError(f"--device {name}: this tool runs on cpu or cuda")
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and (device.index or 0) >= gpus:  # else "invalid device ordinal", deep in a traceback
        raise EvalError(f"--device {name}: this machine has {gpus} GPU(s), cuda:0 to cuda:{gpus - 1}")
    return device


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cleanrl_ddp.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("path", help="a run directory (holding checkpoint.pt) or a checkpoint file")
    parser.add_argument("--episodes", type=int, default=10, help="episodes to play, in parallel (default: 10)")
    policy = parser.add_mutually_exclusive_group()
    policy.add_argument(
        "--greedy",
        dest="greedy",
        action="store_true",
        default=None,
        help="take the likeliest action (DQN, PQN: epsilon 0; TD3: the actor's action)",
    )
    policy.add_argument(
        "--sample",
        dest="greedy",
        action="store_false",
        help="sample actions from the policy (DQN: the run's --eval-epsilon; PQN: its --end-e; TD3: the actor's action "
        "plus the run's --exploration-noise); default: the run's --eval-greedy",
    )
    parser.add_argument("--seed", type=int, default=12345, help="seed of the evaluation envs and sampling")
    parser.add_argument("--capture-video", action="store_true", help="record the first episode to --out-dir")
    parser.add_argument(
        "--out-dir", help="where videos go (default: a new directory evaluate-<run>-step<N> in the working directory)"
    )
    parser.add_argument(
        "--log-to-run", action="store_true", help="also add the video to the training run's TensorBoard events"
    )
    parser.add_argument("--device", default="cpu", help="torch device to run the agent on (default: cpu)")
    parser.add_argument("--env-id", help="the env id, when the checkpoint's has a module prefix (module:Env)")
    options = parser.parse_args(argv)
    if options.episodes < 1:
        raise EvalError(f"--episodes must be at least 1, got {options.episodes}")
    if options.seed < 0:
        raise EvalError(f"--seed must be at least 0, got {options.seed}")
    device = choose_device(options.device)

    ckpt, run_dir = load(options.path)
    script = ckpt["script"]
    module = importlib.import_module(f"cleanrl_ddp.{script}")
    if "agent_kwargs" not in ckpt:
        raise EvalError(f"{options.path} has no agent_kwargs (written by an older {script}); it cannot be evaluated")
    saved = {k: v for k, v in ckpt["args"].items() if k in {f.name for f in fields(module.Args)}}
    wrong = misfit_flags(saved, module.Args)
    if wrong:
        raise EvalError(f"{options.path} holds flags of another type: {', '.join(wrong)}")
    try:
        check_saved_env_id(str(saved.get("env_id")), options.env_id, options.path)
    except RunError as e:
        raise EvalError(str(e)) from None
    if options.env_id is not None and options.env_id != saved.get("env_id"):
        raise EvalError(f"{options.path} trained {saved.get('env_id')}, not --env-id {options.env_id}")
    args = module.Args(**saved)
    try:
        agent = module.load_agent(ckpt, device)
    except LOAD_ERRORS as e:  # a weight of another shape, say
        raise EvalError(f"{options.path} holds an agent that does not fit {script} ({one_line(e)})") from None
    greedy = args.eval_greedy if options.greedy is None else options.greedy  # DQN: sampled = the run's epsilon
    video_dir, video_name = None, None
    if options.capture_video:
        try:
            import moviepy  # noqa: F401
        except ImportError:
            raise EvalError("--capture-video needs moviepy: pip install -e '.[video]'") from None
        video_dir = options.out_dir or new_out_dir(run_dir, ckpt["global_step"])
        video_name = f"evaluate-step{ckpt['global_step']}"
        if os.path.lexists(os.path.join(video_dir, f"{video_name}.mp4")):
            raise EvalError(f"{os.path.join(video_dir, video_name)}.mp4 exists: pass another --out-dir")
    envs = evals.make_envs(module.make_env, args, options.episodes, video_dir, ale=atari.is_atari_script(script))
    try:
        returns, lengths, video = evals.play(
            agent, module.eval_action, envs, args, greedy, options.seed, device, video_name
        )
    finally:
        envs.close()
    if video is not None:
        if options.log_to_run:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(run_dir)  # next to the run's own events: TensorBoard shows it with the run
            evals.log_video(writer, video, ckpt["global_step"], track=False)
            writer.close()
        print(f"video: {video['path']}")
    print(
        f"{script} {args.env_id} at global step {ckpt['global_step']}: return {np.mean(returns):.2f} ± "
        f"{np.std(returns):.2f} (mean ± std over {len(returns)} {'greedy' if greedy else 'sampled'} episodes, "
        f"mean length {np.mean(lengths):.1f})"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except EvalError as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
