"""Evaluation, video and loggers: --eval-every/--target-return in every script, the
`python -m cleanrl_ddp.evaluate` command, --capture-video, W&B offline runs and TensorBoard's config text."""

import ast
import importlib
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import (
    REPO,
    SCRIPTS,
    batch_exit_codes,
    batch_job,
    batch_output,
    event_files,
    launch_batch,
    main_error,
    main_output,
    only_run_dir,
    read_scalars,
    wandb_offline_runs,
)

from cleanrl_ddp import atari, evals
from cleanrl_ddp.evaluate import EvalError
from cleanrl_ddp.evaluate import main as evaluate_main

TINY = ["--local-num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "2"]
CONTINUOUS_TINY = ["--env-id", "InvertedPendulum-v5", "--local-num-envs", "1", "--num-steps", "64"]
CONTINUOUS_TINY += ["--num-minibatches", "2", "--update-epochs", "2"]
# 2 ranks x 2 Breakout games x 16 steps: one iteration is 64 global steps
ATARI_TINY = ["--local-num-envs", "2", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "1"]
# 2 ranks x 2 games: 4 global steps per iteration; a few updates before the evaluation at step 64
DQN_TINY = ["--local-num-envs", "2", "--buffer-size", "400", "--learning-starts", "32", "--train-frequency", "8"]
DQN_TINY += ["--log-every", "32", "--eval-epsilon", "1.0"]  # a random evaluation policy: games end quickly


def evaluate(*args, timeout=120):
    """The evaluate command (`python -m cleanrl_ddp.evaluate`)."""
    cmd = [sys.executable, "-m", "cleanrl_ddp.evaluate", *(str(a) for a in args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def evaluate_here(capsys, *args) -> str:
    """What the evaluate command prints, from its main() in this process (the command itself, its exit code and its
    one-line errors: the first test and test_evaluate_rejects_bad_checkpoints_in_one_line)."""
    capsys.readouterr()
    assert evaluate_main([str(a) for a in args]) == 0
    return capsys.readouterr().out


def tensorboard_text(run_dir, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    texts = []
    for path in event_files(run_dir):
        acc = EventAccumulator(str(path), size_guidance={"tensors": 0})
        acc.Reload()
        if tag in acc.Tags()["tensors"]:
            texts += [t.tensor_proto.string_val[0].decode() for t in acc.Tensors(tag)]
    return "\n".join(texts)


def tensorboard_images(run_dir, tag: str) -> list[int]:
    """The steps of every image (add_video writes a GIF image) logged under `tag`, over all event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for path in event_files(run_dir):
        acc = EventAccumulator(str(path), size_guidance={"images": 0})
        acc.Reload()
        if tag in acc.Tags()["images"]:
            steps += [image.step for image in acc.Images(tag)]
    return sorted(steps)


# script: (flags, the global step of the first evaluation), runs that --target-return 0 stops there (every return
# is >= 0); ppo_multigpu.py's stop: its CartPole learning test
STOP_RUNS = {
    "ppo_atari_multigpu.py": ([*ATARI_TINY, "--total-timesteps", 640, "--eval-every", 64], 64),
    "dqn_atari_multigpu.py": ([*DQN_TINY, "--total-timesteps", 100000, "--eval-every", 64], 64),
    "ppo_continuous_action_multigpu.py": ([*CONTINUOUS_TINY, "--total-timesteps", 512, "--eval-every", 128], 128),
}
VIDEO = {"ppo_atari_multigpu.py": ["--eval-episodes", 1, "--capture-video"]}
VIDEO["dqn_atari_multigpu.py"] = VIDEO["ppo_atari_multigpu.py"]
# CartPole with video and W&B: 4 iterations of 128 global steps, one evaluation, at step 512
WANDB_RUN = "ppo_multigpu.py"
WANDB_FLAGS = [*TINY, "--total-timesteps", 512, "--eval-every", 512, "--eval-episodes", 2, "--capture-video", "--track"]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """The STOP_RUNS and the W&B run on 2 ranks, launched together (helpers.launch_batch: one after another in the
    same two ranks, as their own launches would run them; W&B's last, as it patches TensorBoard's writer for the
    rest of the process): script -> (its runs directory, what its ranks printed, their exit codes). W&B writes its
    offline runs to the folder `wandb` beside the runs directory."""
    scripts = [s for s in STOP_RUNS if "continuous" not in s or importlib.util.find_spec("mujoco")]
    outdirs = {s: tmp_path_factory.mktemp(f"two-ranks-{s[:-3]}") for s in [*scripts, WANDB_RUN]}
    jobs = []
    for script in scripts:
        flags, _ = STOP_RUNS[script]
        args = [*flags, *VIDEO.get(script, ["--eval-episodes", 2]), "--target-return", 0]
        jobs.append(batch_job(script, [*args, "--runs-dir", outdirs[script] / "runs"], outdirs[script]))
    jobs.append(batch_job(WANDB_RUN, [*WANDB_FLAGS, "--runs-dir", outdirs[WANDB_RUN] / "runs"], outdirs[WANDB_RUN]))
    wandb_dir = outdirs[WANDB_RUN] / "wandb"
    wandb_dir.mkdir()
    jobs_file = tmp_path_factory.mktemp("two-ranks") / "jobs.json"
    proc = launch_batch(jobs, 2, jobs_file, timeout=240 * len(jobs), env={"WANDB_DIR": str(wandb_dir)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {s: (o / "runs", batch_output(o, 2), batch_exit_codes(o, 2)) for s, o in outdirs.items()}


def test_eval_video_wandb_and_evaluate_command(tmp_path, two_rank_runs):
    """A 2-rank CartPole job (`two_rank_runs`): rank-0 evaluation and video, one W&B run with the resolved config;
    the evaluate command on its checkpoint (a resumed job continuing the same W&B run: tests/test_runtime.py)."""
    runs, output, exit_codes = two_rank_runs[WANDB_RUN]
    assert exit_codes == [0, 0], output
    run_dir, wandb_dir = only_run_dir(runs), runs.parent / "wandb"

    # rank 0 alone logs (one event file) and records (one video, of the one evaluation)
    assert len(event_files(run_dir)) == 1
    scalars = read_scalars(run_dir)
    assert [step for step, _ in scalars["eval/episodic_return"]] == [512]
    assert [step for step, _ in scalars["eval/episodic_length"]] == [512]
    assert sorted(p.name for p in (run_dir / "videos").iterdir()) == ["eval-step512.mp4"]
    assert (run_dir / "videos/eval-step512.mp4").stat().st_size > 1000
    hyperparameters = tensorboard_text(run_dir, "hyperparameters/text_summary")
    assert "|eval_every|512|" in hyperparameters and "|batch_size|128|" in hyperparameters

    # W&B: one run for the job (not one per rank), holding the resolved config (flags and derived sizes)
    (wandb_run,) = wandb_offline_runs(wandb_dir)
    assert wandb_run["config"]["eval_every"] == 512
    assert wandb_run["config"]["batch_size"] == 128 and wandb_run["config"]["world_size"] == 2
    assert list(wandb_dir.glob("wandb/offline-run-*/files/media/videos/**/*.mp4"))

    # the evaluate command (sampled actions here, greedy in the continuous test); its video goes to --out-dir,
    # never into the run it reads, and never over an existing video
    out_dir = tmp_path / "evaluation"
    proc = evaluate(run_dir / "checkpoint.pt", "--episodes", 3, "--sample", "--capture-video", "--out-dir", out_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ppo_multigpu CartPole-v1 at global step 512: return " in proc.stdout
    assert " ± " in proc.stdout and "over 3 sampled episodes" in proc.stdout
    assert (out_dir / "evaluate-step512.mp4").is_file()
    assert sorted(p.name for p in (run_dir / "videos").iterdir()) == ["eval-step512.mp4"]
    assert len(event_files(run_dir)) == 1 and tensorboard_images(run_dir, "eval/video") == [512]
    with pytest.raises(EvalError, match="evaluate-step512.mp4 exists: pass another --out-dir"):
        evaluate_main([str(run_dir), "--episodes", "1", "--capture-video", "--out-dir", str(out_dir)])


@pytest.mark.parametrize("script", [s for s in STOP_RUNS if "continuous" not in s])
def test_target_return_stops_every_rank_at_the_same_iteration(tmp_path, capsys, two_rank_runs, script):
    """Every return is >= 0: the first evaluation stops the 2-rank Atari job, with a final checkpoint. The run
    records it (frames written by hand: ALE's vector env cannot render), and the evaluate command plays the
    checkpoint and records a video of its own (CartPole's video: the first test; ppo_multigpu.py's stop at a
    target return: tests/test_ppo_multigpu.py's learning test)."""
    _, step = STOP_RUNS[script]
    runs_dir, output, exit_codes = two_rank_runs[script]
    assert exit_codes == [0, 0], output  # both ranks stopped, and alike
    assert f"reached --target-return 0.0 at global step {step};" in output
    run_dir = only_run_dir(runs_dir)
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert ckpt["global_step"] == step  # the final checkpoint, at the stop
    scalars = read_scalars(run_dir)
    assert [s for s, _ in scalars["eval/episodic_return"]] == [step]
    assert max(s for s, _ in scalars["charts/SPS"]) == step  # no rank went on training
    assert ckpt["agent_kwargs"] == dict(n_actions=4)  # Breakout
    assert (run_dir / f"videos/eval-step{step}.mp4").stat().st_size > 1000
    assert tensorboard_images(run_dir, "eval/video") == [step]

    out_dir = tmp_path / "evaluation"
    out = evaluate_here(capsys, run_dir, "--episodes", 2, "--capture-video", "--out-dir", out_dir, "--log-to-run")
    assert f"{script[:-3]} BreakoutNoFrameskip-v4 at global step {step}: return " in out
    assert "over 2 sampled episodes" in out  # the runs' own default (DQN: its --eval-epsilon 1.0)
    assert (out_dir / f"evaluate-step{step}.mp4").stat().st_size > 1000
    assert tensorboard_images(run_dir, "eval/video") == [step, step]  # the run's, and (--log-to-run) evaluate's


# PQN: one process (this one), one evaluation with video after the first iteration, then the evaluate command on the
# checkpoint
# (Atari: epsilon 1 in training and in the sampled evaluation, --end-e: an untrained greedy net may never FIRE)
PQN_RUNS = {
    "pqn_multigpu.py": (["--local-num-envs", 2, "--num-steps", 16, "--num-minibatches", 2], 32, "greedy"),
    "pqn_atari_multigpu.py": (ATARI_TINY + ["--start-e", 1, "--end-e", 1], 32, "sampled"),
}


@pytest.mark.parametrize("script", PQN_RUNS)
def test_pqn_evaluation_video_and_evaluate_command(tmp_path, monkeypatch, capsys, script):
    flags, step, policy = PQN_RUNS[script]
    args = [*flags, "--total-timesteps", step, "--eval-every", step, "--eval-episodes", 2, "--capture-video"]
    main_output(monkeypatch, capsys, script, *args, "--runs-dir", tmp_path / "runs")  # in this process
    run_dir = only_run_dir(tmp_path / "runs")
    assert [s for s, _ in read_scalars(run_dir)["eval/episodic_return"]] == [step]
    assert (run_dir / f"videos/eval-step{step}.mp4").stat().st_size > 1000
    assert tensorboard_images(run_dir, "eval/video") == [step]
    out = evaluate_here(capsys, run_dir, "--episodes", 2, "--capture-video", "--out-dir", tmp_path / "evaluation")
    env_id = "BreakoutNoFrameskip-v4" if "atari" in script else "CartPole-v1"
    assert f"{script[:-3]} {env_id} at global step {step}: return " in out, out
    assert f"over 2 {policy} episodes" in out, out  # the run's own default policy
    assert (tmp_path / "evaluation" / f"evaluate-step{step}.mp4").stat().st_size > 1000


def test_each_script_says_which_envs_it_is_evaluated_in():
    """No dispatch on `make_env`'s signature: the Atari scripts pass `ale=True` to `evals.evaluate` (their make_env is
    ALE's vector env maker), no other script does; the tools that hold only the module (the evaluate command,
    benchmark/throughput.py) read the same from the file name (`atari.is_atari_script`), and every script's make_env
    makes evaluation envs that way."""
    for path in sorted(SCRIPTS.glob("*_multigpu.py")):
        tree = ast.parse(path.read_text())
        call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "evals.evaluate")
        ale = {k.arg: ast.literal_eval(k.value) for k in call.keywords}.get("ale", False)
        assert ale == atari.is_atari_script(path.stem) == atari.is_atari_script(f"cleanrl_ddp.{path.stem}"), path.name
        module = importlib.import_module(f"cleanrl_ddp.{path.stem}")
        env_id = "Pendulum-v1" if "continuous" in path.stem else "CartPole-v1"  # classic control: no extra needed
        envs = evals.make_envs(module.make_env, module.Args() if ale else module.Args(env_id=env_id), 2, ale=ale)
        assert envs.num_envs == 2 and (ale or isinstance(envs, evals.gym.vector.SyncVectorEnv)), path.name
        envs.close()
    for tool in ("cleanrl_ddp/evals.py", "cleanrl_ddp/evaluate.py", "benchmark/throughput.py"):
        assert "signature(" not in (REPO / tool).read_text(), tool


@pytest.mark.parametrize("script", ["ppo_atari_multigpu", "dqn_atari_multigpu", "pqn_atari_multigpu"])
def test_atari_evaluation_keeps_training_streams_and_records_the_game(tmp_path, script):
    """In-process: evaluation draws from its own seeded streams (the same games twice; the training RNGs
    untouched), and the video holds one grayscale frame per step of env 0's whole game."""
    module = importlib.import_module(f"cleanrl_ddp.{script}")
    if script.startswith("ppo"):  # uniform logits, sampled: an untrained Agent's policy, without its CNN's cost
        net, args = SimpleNamespace(hidden=lambda x: torch.zeros(len(x), 4), actor=lambda h: h), module.Args()
    elif script.startswith("dqn"):  # epsilon 1: random actions; an untrained greedy net may never FIRE
        net, args = module.QNetwork(4), module.Args(eval_epsilon=1.0)
    else:  # PQN: the sampled evaluation plays with epsilon --end-e; Q-values without the CNN's cost
        net, args = lambda x: torch.zeros(len(x), 4), module.Args(end_e=1.0)
    eval_envs = evals.make_envs(module.make_env, args, 1, str(tmp_path / "videos"), ale=True)
    torch_state, numpy_state = torch.get_rng_state(), np.random.get_state()[1].copy()
    cpu = torch.device("cpu")
    returns, lengths, video = evals.play(net, module.eval_action, eval_envs, args, False, 7, cpu, "game")
    again, again_lengths, no_video = evals.play(net, module.eval_action, eval_envs, args, False, 7, cpu)
    eval_envs.close()
    assert torch.equal(torch.get_rng_state(), torch_state) and (np.random.get_state()[1] == numpy_state).all()
    assert returns.tolist() == again.tolist() and lengths.tolist() == again_lengths.tolist() and no_video is None
    # PPO's and PQN's envs autoreset in the same step (the game's last frame is never seen); DQN's in the next one
    frames = lengths[0] + (1 if script.startswith("dqn") else 0)
    assert video["frames"].shape == (frames, 84, 84, 3) and video["frames"].dtype == np.uint8
    assert video["path"] == str(tmp_path / "videos/game.mp4") and (tmp_path / "videos/game.mp4").stat().st_size > 1000


def test_continuous_target_return_and_evaluate_with_normalisation(two_rank_runs, capsys):
    pytest.importorskip("mujoco")
    runs_dir, output, exit_codes = two_rank_runs["ppo_continuous_action_multigpu.py"]
    assert exit_codes == [0, 0], output
    assert "reached --target-return 0.0 at global step 128;" in output
    run_dir = only_run_dir(runs_dir)
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert ckpt["iteration"] == 1 and ckpt["agent_kwargs"] == dict(obs_dim=4, action_dim=1)
    assert [step for step, _ in read_scalars(run_dir)["eval/episodic_return"]] == [128]
    out = evaluate_here(capsys, run_dir, "--episodes", 2)
    assert "ppo_continuous_action_multigpu InvertedPendulum-v5 at global step 128: return " in out
    assert "over 2 greedy episodes" in out


@pytest.mark.parametrize("problem", ["missing", "corrupt", "foreign", "other-script", "other-shape", "other-type"])
def test_evaluate_rejects_bad_checkpoints_in_one_line(tmp_path, problem):
    path = tmp_path / "checkpoint.pt"
    if problem == "corrupt":
        path.write_bytes(b"PK\x03\x04 not a whole zip file")
    elif problem == "foreign":
        torch.save({"model": torch.zeros(3)}, path)
    elif problem == "other-script":
        torch.save({"script": "ppo_atari_multigpu", "args": {}}, path)  # an old checkpoint, without agent_kwargs
    elif problem == "other-shape":
        weights = dict(agent_kwargs=dict(obs_dim=4, n_actions=2), agent={"critic.0.weight": torch.zeros(3)})
        torch.save(dict(script="ppo_multigpu", args={}, **weights), path)
    elif problem == "other-type":  # a flag of another type: before, a traceback from gymnasium
        torch.save(dict(script="ppo_multigpu", args=dict(env_id=5), agent_kwargs={}, agent={}), path)
    target = tmp_path if problem == "missing" else path
    expected = {
        "missing": "no checkpoint at",
        "corrupt": "is truncated or corrupt",
        "foreign": "is not a checkpoint of a cleanrl_ddp script",
        "other-script": "has no agent_kwargs (written by an older ppo_atari_multigpu); it cannot be evaluated",
        "other-shape": "holds an agent that does not fit ppo_multigpu (RuntimeError: Error(s) in loading state_dict",
        "other-type": "holds flags of another type: env_id (5)",
    }[problem]
    if problem != "corrupt":  # in this process: the error that the command prints as one line
        with pytest.raises(EvalError, match=re.escape(expected)):
            evaluate_main([str(target)])
        return
    proc = evaluate(target)  # one as the command
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("evaluate: error: ") and expected in lines[0], lines[0]


@pytest.mark.parametrize(
    "script, flag",
    [
        ("ppo_multigpu.py", "--target-return"),
        ("ppo_continuous_action_multigpu.py", "--target-return"),
        ("ppo_atari_multigpu.py", "--target-return"),
        ("ppo_atari_multigpu.py", "--capture-video"),
        ("dqn_atari_multigpu.py", "--capture-video"),  # its --target-return: tests/test_dqn_atari_multigpu.py
    ],
)
def test_eval_flags_are_checked(tmp_path, monkeypatch, script, flag):
    flags = [flag, 10] if flag == "--target-return" else [flag]
    assert f"{flag} needs --eval-every" in main_error(monkeypatch, script, *flags, "--runs-dir", tmp_path)
    assert not any(tmp_path.iterdir())
