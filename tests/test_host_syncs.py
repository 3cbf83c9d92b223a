"""The host-sync budget: each script's training loop, run in this process on the CPU, may make the host wait
for the device (tests/host_syncs.py counts it) no more often than its budget below. A new `.item()`, a
pageable copy or a boolean mask in the loop fails here, with the call sites, long before a GPU shows it.

Budgets are waits of all kinds (reads, pageable copies, data-dependent shapes) per env step (all local envs
stepped once), per update (a minibatch, or a critic gradient step) and per logged step, counted with the
small configurations below (CleanRL's structure: 4 minibatches become 2, 128 steps 16-32...). Per env step
PPO needs one read (the actions to the envs) plus the copies of what the envs returned; a logged step reads
its metrics once and votes on preemption once.
"""

import pytest
from host_syncs import count_in_subprocess

PPO_SMALL = ["--num-minibatches", 2, "--update-epochs", 2]
OFF_POLICY_SMALL = ["--buffer-size", 200, "--checkpoint-every", 0]
CONFIGS = {  # script: (local envs, flags); each runs 4 logged steps or more after its first update
    "ppo_multigpu.py": (4, [*PPO_SMALL, "--num-steps", 32, "--total-timesteps", 4 * 4 * 32]),
    "ppo_atari_multigpu.py": (2, [*PPO_SMALL, "--local-num-envs", 2, "--num-steps", 16, "--total-timesteps", 128]),
    "ppo_atari_async_multigpu.py": (
        2,
        [*PPO_SMALL, "--local-num-envs", 2, "--num-steps", 16, "--total-timesteps", 128],
    ),
    "ppo_continuous_action_multigpu.py": (1, [*PPO_SMALL, "--num-steps", 32, "--total-timesteps", 128]),
    "pqn_multigpu.py": (4, [*PPO_SMALL, "--num-steps", 32, "--total-timesteps", 4 * 4 * 32]),
    "pqn_atari_multigpu.py": (2, [*PPO_SMALL, "--local-num-envs", 2, "--num-steps", 16, "--total-timesteps", 128]),
    "dqn_atari_multigpu.py": (
        1,
        [*OFF_POLICY_SMALL, "--learning-starts", 32, "--train-frequency", 4, "--target-network-frequency", 32]
        + ["--local-batch-size", 8, "--log-every", 16, "--total-timesteps", 112],
    ),
    "sac_continuous_action_multigpu.py": (
        1,
        [*OFF_POLICY_SMALL, "--learning-starts", 16, "--local-batch-size", 16, "--log-every", 16]
        + ["--total-timesteps", 80],
    ),
    "td3_continuous_action_multigpu.py": (
        1,
        [*OFF_POLICY_SMALL, "--learning-starts", 16, "--local-batch-size", 16, "--log-every", 16]
        + ["--total-timesteps", 80],
    ),
}

# Waits allowed per env step, per update and per logged step. PPO and PQN: the actions to the envs (the async script
# sends each half's actions on their own: 2 per env step; PQN's exploration draws stay on the device), nothing per
# minibatch, and per logged step the metrics' one read, their copies in rt.all_sum, the preemption vote (and the
# continuous script's normalisation statistics). DQN, SAC and TD3: the actions (greedy Q-values for DQN) to the envs
# per env step, nothing per update (samples drawn on the device, or copied from pinned staging; losses summed on the
# device), and per logged step the metrics' one read, their copies in rt.all_sum and the preemption vote (main at
# fbecd7e: DQN 2/5/7, SAC 5/15/8, TD3 2/5/8). The functions a GPU captures with --cudagraphs (`graphs.graphed`, eager
# on the CPU; every script runs with the flag) may not wait at all, their optimizers' steps included: each update and
# the action choice of SAC and TD3, every script's policy step (and the PPO's GAE and minibatch update, PQN's
# Q(lambda) returns, DQN's greedy actions).
BUDGETS = {
    "ppo_multigpu.py": (1, 0, 6),
    "ppo_atari_multigpu.py": (1, 0, 6),
    "ppo_atari_async_multigpu.py": (2, 0, 6),
    "ppo_continuous_action_multigpu.py": (1, 0, 7),
    "pqn_multigpu.py": (1, 0, 6),
    "pqn_atari_multigpu.py": (1, 0, 6),
    "dqn_atari_multigpu.py": (1, 0, 7),
    "sac_continuous_action_multigpu.py": (1, 0, 8),
    "td3_continuous_action_multigpu.py": (1, 0, 8),
}


@pytest.mark.parametrize("script", sorted(CONFIGS))
def test_host_waits_within_budget(script, tmp_path):
    local_num_envs, flags = CONFIGS[script]
    counts = count_in_subprocess(script, [*flags, "--runs-dir", tmp_path, "--seed", 1, "--cudagraphs"], local_num_envs)
    print(f"{script}\n{counts.table()}")
    measured = tuple(counts.per(phase) for phase in ("env_step", "update", "logged"))
    over = [
        f"{phase}: {value:.3f} > {budget}"
        for phase, value, budget in zip(
            ("per env step", "per update", "per logged step"), measured, BUDGETS[script], strict=True
        )
        if value > budget + 1e-9
    ]
    assert not over, f"{script} waits for the device more often than its budget ({'; '.join(over)}):\n{counts.table()}"
    assert counts.per("captured") == 0, (
        f"{script} waits inside a function that --cudagraphs captures:\n{counts.table()}"
    )
    assert counts.markers["captured"] > 0, counts.table()
