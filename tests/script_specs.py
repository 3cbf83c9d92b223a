"""The scripts that tests/test_distributed_correctness.py covers, and how the tests drive each: one `ScriptSpec` per
script in `SCRIPTS` (read also by tests/test_cudagraphs.py, tests/graph_capture.py and the modes of
tests/dist_worker.py). A new script is covered by adding one entry."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class ScriptSpec:
    """How the tests drive one script: one entry per script in `SCRIPTS` below."""

    script: str
    make_agent: Callable
    """module -> an Agent, built the way the script builds it"""
    make_obs: Callable
    """(n, torch.Generator) -> a batch of n observations the agent accepts"""
    tiny: list = field(default_factory=list)
    """flags for the smallest whole-script run that still does several updates per iteration"""
    local_batch: int = 0
    """local_num_envs x num_steps under `tiny`"""
    target_kl: list = field(default_factory=list)
    """flags under which the per-rank (local) KLs cross --target-kl at different epochs (PPO; empty: no --target-kl)"""
    iterations: dict = field(default_factory=lambda: {2: 6, 3: 4})
    """world size -> iterations of the whole-script runs"""
    dqn: bool = False
    """a DQN script: td_loss with a target network (the script's own class), no --target-kl, no gradient clipping;
    the whole-script runs also record the target network"""
    pqn: bool = False
    """a PQN script: its own update_q_network (MSE to Q(lambda) returns, the averaged gradient clipped, RAdam), no
    target network, no --target-kl"""
    sac: bool = False
    """an off-policy actor-critic script (SAC): its own unit test (`unit_sac`: critics, actor and log_alpha); the
    whole-script runs record every optimizer's final parameters"""
    td3: bool = False
    """TD3: its own unit test (`unit_td3`: critics, actor and both target networks); as SAC's whole-script runs"""
    target_classes: tuple = ()
    """the classes of the script's target networks (the instances no optimizer holds), recorded by whole-script runs"""
    update_rtol: float = 1e-5
    """tolerance of the parameter change in the equivalence test (the gradients are held to 1e-5 for every script)"""
    two_nodes: bool = False
    """whether tests run the two-node launch and the diverged run for this script: launch, rank discovery and the
    replica check are the run module's, the same for every script, so one script (ppo_multigpu.py) carries them"""
    whole_runs: tuple = (("ddp", 2), ("flat", 3))
    """(gradient path, world size) of the instrumented whole-script runs that guarantees 1, 2 and 5-7 read"""
    compiled: tuple = ()
    """the functions that the script's --compile compiles (its losses); empty: the script has no --compile"""
    compile_timesteps: int = 0
    """--total-timesteps of the 2-rank --compile runs of `unit` (with `tiny`): a few updates of every loss"""
    captured: dict = field(default_factory=dict)
    """the functions --cudagraphs captures (tests/graph_capture.py, `captured_runs`), by run: "1" (world size 1), and
    "ddp" and "flat" where the unit launch also runs it on 2 ranks; empty: the script has no --cudagraphs path"""
    capture_flags: list = field(default_factory=list)
    """flags of the --cudagraphs runs (tests/graph_capture.py), at the script's default learning rate: every function
    replays at least once"""
    capture_timesteps: int = 0
    """--total-timesteps of the world-size-1 --cudagraphs run (twice that on 2 ranks)"""


# the --cudagraphs runs of the PPO and PQN scripts: 4 iterations of 2 envs x 8 steps per rank, 2 minibatches (GAE
# replays once, the update 5 times), at the default learning rate
PPO_CAPTURE = ["--local-num-envs", "2", "--num-steps", "8", "--num-minibatches", "2", "--update-epochs", "1"]
PPO_CAPTURE += ["--checkpoint-every", "0"]
# SAC's and TD3's whole runs on Pendulum-v1 (1 env per rank): updates from global step 32, two per iteration (8
# transitions per rank each); their --cudagraphs runs the same, with the replica check every iteration
OFF_POLICY_TINY = ["--env-id", "Pendulum-v1", "--local-num-envs", "1", "--buffer-size", "240", "--learning-starts"]
OFF_POLICY_TINY += ["32", "--local-batch-size", "8", "--updates-per-iteration", "2", "--log-every", "8"]
OFF_POLICY_TINY += ["--checkpoint-every", "0"]
OFF_POLICY_CAPTURE = [*OFF_POLICY_TINY, "--sync-check-every", "1"]

SCRIPTS = {
    spec.script: spec
    for spec in [
        ScriptSpec(
            "ppo_multigpu.py",
            make_agent=lambda m: m.Agent(4, 2),
            make_obs=lambda n, g: torch.randn(n, 4, generator=g),
            tiny=["--local-num-envs", "2", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "2"],
            local_batch=32,
            target_kl=["--update-epochs", "8", "--learning-rate", "0.01", "--target-kl", "0.003"],
            two_nodes=True,
            captured={"1": ("policy_step", "advantages_and_returns", "update")},
            capture_flags=PPO_CAPTURE,
            capture_timesteps=4 * 2 * 8,
        ),
        ScriptSpec(
            "ppo_atari_multigpu.py",  # uint8 frames, NCHW view of an NHWC buffer as in the script
            make_agent=lambda m: m.Agent(4),
            make_obs=lambda n, g: torch.randint(0, 256, (n, 84, 84, 4), generator=g, dtype=torch.uint8).permute(
                0, 3, 1, 2
            ),
            tiny=["--local-num-envs", "2", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "2"],
            local_batch=32,
            target_kl=["--update-epochs", "8", "--learning-rate", "0.01", "--target-kl", "0.02"],
            compiled=("ppo_loss",),
            compile_timesteps=64,  # one iteration: 4 minibatch updates
            captured={
                "1": ("policy_step", "advantages_and_returns", "update"),
                "flat": ("policy_step", "advantages_and_returns", "minibatch_backward", "clip_and_step"),
                "ddp": ("policy_step", "advantages_and_returns", "clip_and_step"),  # DDP all-reduces in backward
            },
            # 4 iterations of 2 envs x 8 steps per rank, 2 minibatches: GAE replays once, the update 5 times
            capture_flags=["--local-num-envs", "2", "--num-steps", "8", "--num-minibatches", "2", "--update-epochs"]
            + ["1", "--checkpoint-every", "0"],
            capture_timesteps=4 * 2 * 8,
        ),
        ScriptSpec(
            "ppo_atari_async_multigpu.py",  # the Atari PPO with its rollout in two halves (one env each here)
            make_agent=lambda m: m.Agent(4),
            make_obs=lambda n, g: torch.randint(0, 256, (n, 84, 84, 4), generator=g, dtype=torch.uint8).permute(
                0, 3, 1, 2
            ),
            tiny=["--local-num-envs", "2", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "2"],
            local_batch=32,
            # only the rollout differs from ppo_atari_multigpu.py: its update, gradient paths, --target-kl and odd
            # world sizes are that script's (same functions), so one whole run, ddp on 2 ranks, covers the rollout
            whole_runs=(("ddp", 2),),
            # --cudagraphs at world size 1 only: its 2-rank update is ppo_atari_multigpu.py's, checked there
            captured={"1": ("policy_step(h=0)", "policy_step(h=1)", "advantages_and_returns", "update")},
            capture_flags=["--local-num-envs", "2", "--num-steps", "8", "--num-minibatches", "2", "--update-epochs"]
            + ["1", "--checkpoint-every", "0"],
            capture_timesteps=4 * 2 * 8,
        ),
        ScriptSpec(
            "ppo_continuous_action_multigpu.py",  # unit: HalfCheetah-v5's 17 observations, 6 actions
            make_agent=lambda m: m.Agent(17, 6),
            make_obs=lambda n, g: torch.randn(n, 17, generator=g),
            # whole runs on InvertedPendulum-v5: its episodes end within a tiny run (HalfCheetah's last 1000 steps)
            tiny=["--env-id", "InvertedPendulum-v5", "--local-num-envs", "2", "--num-steps", "16"]
            + ["--num-minibatches", "2", "--update-epochs", "2"],
            local_batch=32,
            target_kl=["--update-epochs", "8", "--learning-rate", "0.01", "--target-kl", "0.003"],
            captured={"1": ("policy_step", "advantages_and_returns", "update")},
            capture_flags=["--env-id", "InvertedPendulum-v5", *PPO_CAPTURE],
            capture_timesteps=4 * 2 * 8,
        ),
        ScriptSpec(
            "dqn_atari_multigpu.py",  # Breakout: 4 actions; uint8 frame stacks, NCHW
            make_agent=lambda m: m.QNetwork(4),
            make_obs=lambda n, g: torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
            # 2 envs per rank; updates from global step 64, one per 4 global steps (8 transitions per rank);
            # target syncs every 32 global steps; epsilon stays high (random actions on every rank)
            tiny=["--local-num-envs", "2", "--buffer-size", "240", "--learning-starts", "64", "--train-frequency", "4"]
            + ["--local-batch-size", "8", "--target-network-frequency", "32", "--exploration-fraction", "2.0"]
            + ["--log-every", "16", "--checkpoint-every", "0"],
            local_batch=2,  # env steps per rank per iteration: --local-num-envs
            iterations={2: 36, 3: 24},
            dqn=True,
            target_classes=("QNetwork",),
            # the script's Adam eps is 1e-8 (CleanRL's), not PPO's 1e-5: Adam divides by |gradient| + eps, so entries
            # with gradients near fp32 rounding noise move by up to lr either way (measured 1.5e-5 relative)
            update_rtol=1e-4,
            captured={"1": ("greedy_actions",)},  # --cudagraphs: the greedy actions only
            capture_flags=[
                "--local-num-envs",
                "2",
                "--buffer-size",
                "240",
                "--learning-starts",
                "32",
                "--log-every",
                "16",
            ]
            + ["--train-frequency", "4", "--local-batch-size", "8", "--target-network-frequency", "32"]
            + ["--checkpoint-every", "0"],
            capture_timesteps=112,  # greedy steps from global step 12 (epsilon at 0.01 after 10% of the run)
        ),
        ScriptSpec(
            "pqn_multigpu.py",  # CartPole: 4 observations, 2 actions
            make_agent=lambda m: m.QNetwork(4, 2),
            make_obs=lambda n, g: torch.randn(n, 4, generator=g),
            tiny=["--local-num-envs", "2", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "2"],
            local_batch=32,
            pqn=True,
            captured={"1": ("policy_step", "lambda_returns")},  # --cudagraphs: the update stays eager
            capture_flags=PPO_CAPTURE,
            capture_timesteps=4 * 2 * 8,
        ),
        ScriptSpec(
            "pqn_atari_multigpu.py",  # Breakout: 4 actions; uint8 frame stacks, NCHW
            make_agent=lambda m: m.QNetwork(4),
            make_obs=lambda n, g: torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
            tiny=["--local-num-envs", "2", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "2"],
            local_batch=32,
            pqn=True,
            update_rtol=1e-4,  # RAdam's first steps move a weight by lr x its gradient: small against fp32 rounding
            # the update and both gradient paths are checked by the unit launch, and the loop's shape by
            # pqn_multigpu.py's runs (DDP on 2 ranks, flat on 3, and the pinned runs at 1, 2 and 3): one whole run here
            whole_runs=(("ddp", 2),),
            captured={"1": ("policy_step", "lambda_returns")},  # --cudagraphs: the update stays eager
            capture_flags=["--local-num-envs", "2", "--num-steps", "8", "--num-minibatches", "2", "--update-epochs"]
            + ["1", "--checkpoint-every", "0"],
            capture_timesteps=4 * 2 * 8,
        ),
        ScriptSpec(
            "sac_continuous_action_multigpu.py",  # unit: Hopper-v5's 11 observations, 3 actions
            make_agent=lambda m: m.Actor(11, 3, [-1.0] * 3, [1.0] * 3),
            make_obs=lambda n, g: torch.randn(n, 11, generator=g),
            tiny=OFF_POLICY_TINY,  # the actor and temperature after every 2nd update, the targets after every one
            local_batch=1,  # env steps per rank per iteration: --local-num-envs
            iterations={2: 28, 3: 20},
            sac=True,
            target_classes=("TwinQ",),
            update_rtol=1e-4,  # Adam's eps 1e-8, as DQN's
            compiled=("critic_loss", "policy_loss", "temperature_loss"),
            compile_timesteps=36,  # updates at global steps 34 and 36: 4 critic, 4 actor and 4 temperature steps
            # each update whole at world size 1, cut at its all-reduces at 2 ranks: flat between the backward and the
            # step, DDP inside the backward, which then runs eagerly (the action choice is the lambda)
            captured={
                "1": ("<lambda>", "update_targets", "update_critics", "update_actor"),
                "flat": ("<lambda>", "update_targets", "critic_backward", "actor_backward", "temperature_backward")
                + ("critic_step", "actor_step", "temperature_step"),
                "ddp": ("<lambda>", "update_targets", "temperature_backward", "critic_step", "actor_step")
                + ("temperature_step",),
            },
            capture_flags=OFF_POLICY_CAPTURE,
            capture_timesteps=44,  # 6 iterations with updates: 6 actions, 12 critic and 12 actor steps
        ),
        ScriptSpec(
            "td3_continuous_action_multigpu.py",  # unit: Hopper-v5's 11 observations, 3 actions
            make_agent=lambda m: m.Actor(11, 3, [-1.0] * 3, [1.0] * 3),
            make_obs=lambda n, g: torch.randn(n, 11, generator=g),
            tiny=OFF_POLICY_TINY,  # the actor and both target networks after every 2nd update
            local_batch=1,
            iterations={2: 28, 3: 20},
            td3=True,
            target_classes=("Actor", "TwinQ"),
            update_rtol=1e-4,
            compiled=("critic_loss", "policy_loss"),
            compile_timesteps=36,  # updates at global steps 34 and 36: 4 critic and 2 actor steps
            captured={
                "1": ("<lambda>", "update_critics", "update_actor"),
                "flat": ("<lambda>", "critic_backward", "actor_backward", "critic_step", "actor_step_and_targets"),
                "ddp": ("<lambda>", "critic_step", "actor_step_and_targets"),
            },
            capture_flags=OFF_POLICY_CAPTURE,
            capture_timesteps=44,  # 6 iterations with updates: 6 actions, 12 critic and 6 actor steps
        ),
    ]
}
