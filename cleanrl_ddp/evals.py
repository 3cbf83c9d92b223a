"""Evaluation, written once for every script, as CleanRL keeps it in `cleanrl_utils/evals/`: an agent plays one
episode per env (Atari: one whole game, all lives) in envs of its own, made by the script's `make_env`.

    reached = evals.evaluate(run, agent, eval_action, make_env, prev_step, global_step)  # the training loop
    python -m cleanrl_ddp.evaluate runs/<run>                                            # a checkpoint

A script offers its `make_env` (gymnasium's thunk maker, `make_env(env_id, render_mode)`; the Atari scripts, which
pass `ale=True`: ALE's vector env maker, `make_env(env_id, num_envs, num_threads, repeat_action_probability)`),
`load_agent(ckpt, device)` and `eval_action(agent, obs, greedy, generator, args)`: the actions for a batch of
observations (a tensor on the agent's device), the likeliest (`greedy`) or sampled with `generator`.
docs/runtime.md#evaluation describes them.
"""

import os
from typing import Optional

import gymnasium as gym
import numpy as np
import torch

from cleanrl_ddp import atari
from cleanrl_ddp import runtime as rt


def evaluate(run: rt.Run, agent, eval_action, make_env, prev_step: int, global_step: int, ale: bool = False) -> bool:
    """Every --eval-every global steps (one crossed since `prev_step`): rank 0 plays --eval-episodes episodes in
    new envs (`make_envs`; `ale`: `make_env` is ALE's vector env maker), logs them (and a video of the first with
    --capture-video), and every rank learns whether they reached --target-return. The other ranks wait in the
    broadcast meanwhile; the time is left out of SPS."""
    args = run.args
    if not rt.steps_crossed(prev_step, global_step, args.eval_every):
        return False
    stop = False
    with rt.off_the_clock(run):
        if run.is_main:
            video_dir = os.path.join(run.run_dir, "videos") if args.capture_video else None
            envs = make_envs(make_env, args, args.eval_episodes, video_dir, ale)
            seed = args.seed + 10**9 + global_step  # seeds no training env uses
            try:
                video_name = f"eval-step{global_step}" if video_dir else None
                result = play(agent, eval_action, envs, args, args.eval_greedy, seed, run.device, video_name)
            finally:
                envs.close()
            stop = log(run, *result, global_step)
        return bool(rt.broadcast_from_main(run, stop))


def make_envs(make_env, args, num_envs: int, video_dir: Optional[str] = None, ale: bool = False):
    """`num_envs` envs apart from the training ones, made by the script's `make_env`: with `ale`, ALE's vector env
    (it cannot render: `play` writes env 0's frames to `video_dir` itself), else gymnasium envs from `make_env`'s
    thunks, whose env 0 records its videos to `video_dir` once `play` starts it."""
    if ale:  # ALE's C++ vector env
        threads = min(torch.get_num_threads(), num_envs)
        envs = make_env(args.env_id, num_envs, threads, atari.sticky_action_probability(args))
        envs.video_dir = video_dir
        return envs
    thunks = [make_env(args.env_id, "rgb_array" if video_dir and i == 0 else None) for i in range(num_envs)]
    if video_dir:
        first = thunks[0]
        thunks[0] = lambda: gym.wrappers.RecordVideo(first(), video_dir, lambda _: False, disable_logger=True)
    return gym.vector.SyncVectorEnv(thunks)


def play(agent, eval_action, envs, args, greedy: bool, seed: int, device, video_name: Optional[str] = None):
    """One episode in each env of `envs` (from `make_envs`), acting with `eval_action` on `device`; returns
    (returns, lengths, video). Rank 0 only.

    The envs are seeded from `seed`, and sampled actions come from a generator of their own, seeded alike:
    evaluating never moves the training streams. ALE's episodes are whole games, scored in the game's points.
    With `video_name`, env 0's episode is saved as {video_dir}/{video_name}.mp4 and `video` is dict(path,
    frames [T, H, W, C] uint8, fps); otherwise it is None.
    """
    episodes = envs.num_envs
    generator = torch.Generator(device=device).manual_seed(seed)
    obs, info = envs.reset(seed=seed)  # env i: seed + i
    prev_lives = info.get("lives")
    # same-step autoreset (ALE's in the PPO scripts): at the end of an episode `obs` is already the next one's
    same_step = envs.metadata["autoreset_mode"] == gym.vector.AutoresetMode.SAME_STEP
    recorder = envs.envs[0] if video_name is not None and hasattr(envs, "envs") else None
    frames = [obs[0, -1]] if video_name is not None and recorder is None else None  # ALE: the newest frame
    if recorder is not None:
        recorder.start_recording(video_name)
        recorder.recorded_frames.append(recorder.render())  # the first frame, before any action
    space = envs.single_action_space
    returns, lengths = np.zeros(episodes), np.zeros(episodes, dtype=np.int64)
    running, video = np.ones(episodes, dtype=bool), None
    while running.any():
        with torch.no_grad():
            action = eval_action(agent, torch.as_tensor(obs, device=device), greedy, generator, args)
        action = action.cpu().numpy()
        if isinstance(space, gym.spaces.Box):
            action = action.clip(space.low, space.high)
        obs, reward, terminations, truncations, info = envs.step(action)
        over = terminations | truncations
        if same_step and "lives" in info:  # a lost life ends an episode for learning, not the game
            over = atari.game_over(terminations, truncations, info["lives"], prev_lives)
            prev_lives = info["lives"]
        returns += reward * running
        lengths += running
        if frames is not None and running[0] and not (same_step and over[0]):
            frames.append(obs[0, -1])
        running &= ~over  # later episodes of a finished env are ignored
        if recorder is not None and recorder.recording and not running[0]:
            path = os.path.join(recorder.video_folder, f"{video_name}.mp4")
            video = dict(path=path, frames=np.stack(recorder.recorded_frames), fps=recorder.frames_per_sec)
            recorder.stop_recording()  # writes the MP4
    if frames is not None:  # 60 emulator frames per second, 4 per agent step: 15 frames per second is real time
        video = write_video(frames, envs.video_dir, video_name, fps=15)
    return returns, lengths, video


def log(run: rt.Run, returns, lengths, video: Optional[dict], global_step: int) -> bool:
    """Rank 0: log an evaluation (and its video); whether it reached --target-return."""
    run.writer.add_scalar("eval/episodic_return", returns.mean(), global_step)
    run.writer.add_scalar("eval/episodic_length", lengths.mean(), global_step)
    if video is not None:
        log_video(run.writer, video, global_step, run.args.track)
    target = run.args.target_return
    if target is None or returns.mean() < target:
        return False
    print(
        f"\n{run.script}: evaluation return {returns.mean():.1f} reached --target-return {target} "
        f"at global step {global_step}; checkpoint saved in {run.run_dir}",
        flush=True,
    )
    return True


def write_video(frames: list, video_dir: str, name: str, fps: int) -> dict:
    """Write frames ([H, W] grayscale or [H, W, 3]) to {video_dir}/{name}.mp4; returns what `log_video` takes."""
    from moviepy.video.io.ImageSequenceClip import ImageSequenceClip

    rgb = np.stack(frames)
    rgb = np.repeat(rgb[..., None], 3, axis=-1) if rgb.ndim == 3 else rgb  # grayscale -> [T, H, W, 3]
    os.makedirs(video_dir, exist_ok=True)
    path = os.path.join(video_dir, f"{name}.mp4")
    ImageSequenceClip(list(rgb), fps=fps).write_videofile(path, logger=None)
    return dict(path=path, frames=rgb, fps=fps)


def log_video(writer, video: dict, global_step: int, track: bool) -> None:
    """Attach an evaluation video to TensorBoard and, with --track, to W&B."""
    frames = video["frames"][:: max(1, len(video["frames"]) // 200)]  # TensorBoard stores a GIF: keep it small
    stride = -(-max(frames.shape[1:3]) // 320)  # at most 320 pixels a side: 85 CartPole frames took 4.3 s, now 0.6
    frames = frames[:, ::stride, ::stride]
    fps = video["fps"] * len(frames) / len(video["frames"])
    writer.add_video("eval/video", frames.transpose(0, 3, 1, 2)[None], global_step, fps=max(1, round(fps)))
    if track:
        import wandb

        wandb.log({"eval/video": wandb.Video(video["path"], format="mp4")})
