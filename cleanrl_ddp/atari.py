"""The ALE helpers of the Atari scripts (PPO, PQN and DQN): which scripts they are, the game behind an env id, the
sticky-action protocol of the id, reward clipping, and whole games told apart from lost lives. CleanRL imports the
same from gymnasium's and SB3's Atari wrappers; here ALE's C++ vector env does the preprocessing, and these are what
is left.
"""

import re

import ale_py
import numpy as np

from cleanrl_ddp.errors import RunError


def is_atari_script(script: str) -> bool:
    """Whether `script` (`ppo_atari_multigpu`, or its module's name) is an Atari script, whose `make_env` is ALE's
    vector env maker, `make_env(env_id, num_envs, num_threads, repeat_action_probability)`: a script's file name
    names its env family (`<algo>_atari[_<variant>]_multigpu.py`). For tools that hold only the module; a script's
    own loop says it (`evals.evaluate(..., ale=True)`)."""
    return "atari" in script.rsplit(".", 1)[-1].split("_")


def ale_game(env_id: str) -> str:
    """The ALE ROM name for `BreakoutNoFrameskip-v4`, `ALE/Breakout-v5`, `Breakout` or `breakout`."""
    name = re.sub(r"(NoFrameskip|Deterministic)?-v[0-9]+$", "", env_id.removeprefix("ALE/"))
    game = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()  # MsPacman -> ms_pacman
    roms = ale_py.roms.get_all_rom_ids()
    if game not in roms:
        raise RunError(
            f"unknown --env-id {env_id!r}: not an ALE game; try BreakoutNoFrameskip-v4, ALE/Pong-v5 or "
            f"space_invaders (one of {len(roms)} ROMs in ale_py.roms.get_all_rom_ids())"
        )
    return game


def sticky_action_probability(args) -> float:
    """`--repeat-action-probability`, by default the id's protocol: 0.25 for `ALE/*-v5` (Machado et al., 2018),
    else 0.0 (the v4 protocol); `run.check_values` keeps a given one in [0, 1]."""
    p = args.repeat_action_probability
    if p is None:
        p = 0.25 if args.env_id.startswith("ALE/") and args.env_id.endswith("-v5") else 0.0
    return p


def clip_reward(reward: np.ndarray) -> np.ndarray:
    """DeepMind reward clipping: the sign of the game reward (-1, 0, 1)."""
    return np.sign(reward).astype(np.float32)


def game_over(terminations, truncations, lives, prev_lives):
    """Which envs finished a whole game this step, not just lost a life (envs made with `life_loss_info`).

    Every life loss sets `terminated`, but only a game over resets the game, and with same-step autoreset
    `info["lives"]` then already shows the new game's (full) lives.
    """
    return truncations | (terminations & (lives >= prev_lives))
