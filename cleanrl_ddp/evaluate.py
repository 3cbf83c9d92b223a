"""Evaluate a trained run: load its checkpoint with the script's own Agent and evaluation, print mean ± std.

    python -m cleanrl_ddp.evaluate runs/CartPole-v1__ppo_multigpu__1__1700000000 --episodes 10
    python -m cleanrl_ddp.evaluate runs/.../checkpoint.pt --sample --capture-video

The checkpoint's "script" key names the script module (cleanrl_ddp/<script>.py); this tool uses the
evaluation interface every script offers (cleanrl_ddp/runtime.py): `load_agent(ckpt, device)`,
`make_eval_envs(args, num_envs, video_dir)` and `evaluate(agent, eval_envs, args, greedy, seed, device,
video_name)`, with the run's own `Args`. Atari episodes are whole games (all lives), scored with the
game's own points. DQN plays epsilon-greedily: `--greedy` is epsilon 0, `--sample` the run's `--eval-epsilon`.
Videos (`--capture-video`, needs `pip install -e ".[video]"`) go to RUN_DIR/videos and into RUN_DIR's
TensorBoard events. Bad input ends with one line `evaluate: error: ...` and exit code 2.
"""

import argparse
import importlib
import os
import sys
from dataclasses import fields

import numpy as np
import torch

from cleanrl_ddp.runtime import EXIT_BAD_INPUT, log_video


class EvalError(Exception):
    """A problem with the user's input, printed as one line."""


def load(path: str) -> tuple[dict, str]:
    """The checkpoint at `path` (a run directory or a checkpoint file) and its run directory."""
    if os.path.isdir(path):
        path = os.path.join(path, "checkpoint.pt")
    if not os.path.isfile(path):
        raise EvalError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises several error types for truncated or foreign files
        raise EvalError(f"{path} is truncated or corrupt, or not a torch checkpoint ({type(e).__name__})")
    script = ckpt.get("script") if isinstance(ckpt, dict) else None
    if not isinstance(script, str) or not script.endswith("_multigpu"):
        raise EvalError(f"{path} is not a checkpoint of a cleanrl_ddp script (script: {script!r})")
    if not os.path.isfile(os.path.join(os.path.dirname(__file__), f"{script}.py")):
        raise EvalError(f"{path} was written by {script!r}, which is not a script of this cleanrl_ddp")
    return ckpt, os.path.dirname(os.path.abspath(path))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cleanrl_ddp.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("path", help="a run directory (holding checkpoint.pt) or a checkpoint file")
    parser.add_argument("--episodes", type=int, default=10, help="episodes to play, in parallel (default: 10)")
    policy = parser.add_mutually_exclusive_group()
    policy.add_argument(
        "--greedy", dest="greedy", action="store_true", default=None, help="take the likeliest action (DQN: epsilon 0)"
    )
    policy.add_argument(
        "--sample",
        dest="greedy",
        action="store_false",
        help="sample actions from the policy (DQN: the run's --eval-epsilon); default: the run's --eval-greedy",
    )
    parser.add_argument("--seed", type=int, default=12345, help="seed of the evaluation envs and sampling")
    parser.add_argument("--capture-video", action="store_true", help="record the first episode to RUN_DIR/videos")
    parser.add_argument("--device", default="cpu", help="torch device to run the agent on (default: cpu)")
    options = parser.parse_args(argv)
    if options.episodes < 1:
        raise EvalError(f"--episodes must be at least 1, got {options.episodes}")

    ckpt, run_dir = load(options.path)
    script = ckpt["script"]
    module = importlib.import_module(f"cleanrl_ddp.{script}")
    if "agent_kwargs" not in ckpt:
        raise EvalError(f"{options.path} has no agent_kwargs (written by an older {script}); it cannot be evaluated")
    saved = {k: v for k, v in ckpt["args"].items() if k in {f.name for f in fields(module.Args)}}
    args = module.Args(**saved)
    device = torch.device(options.device)
    agent = module.load_agent(ckpt, device)
    greedy = args.eval_greedy if options.greedy is None else options.greedy  # DQN: sampled = the run's epsilon
    video_dir, video_name = None, None
    if options.capture_video:
        try:
            import moviepy  # noqa: F401
        except ImportError:
            raise EvalError("--capture-video needs moviepy: pip install -e '.[video]'") from None
        video_dir, video_name = os.path.join(run_dir, "videos"), f"evaluate-step{ckpt['global_step']}"
    eval_envs = module.make_eval_envs(args, options.episodes, video_dir)
    try:
        returns, lengths, video = module.evaluate(agent, eval_envs, args, greedy, options.seed, device, video_name)
    finally:
        eval_envs.close()
    if video is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(run_dir)  # next to the run's own events: TensorBoard shows it with the run
        log_video(writer, video, ckpt["global_step"], track=False)
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
