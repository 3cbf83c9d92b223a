"""Env state as data: what a gymnasium env needs to continue exactly, as tensors and numbers, so that a
checkpoint loads without unpickling objects. Imported by the scripts that save their envs' state
(ppo_multigpu.py, pqn_multigpu.py, ppo_continuous_action_multigpu.py); docs/runtime.md#env-state-as-data describes it.

One function pair per env family (classic control, MuJoCo); a family without one falls back to new episodes.
"""

from typing import Optional

import numpy as np
import torch

from cleanrl_ddp.run import Run

WRAPPER_STATE = ("_elapsed_steps", "_has_reset", "checked_reset", "checked_step", "checked_render")
"""the wrappers' own state: TimeLimit's step count, OrderEnforcing's and the env checker's flags"""
CLASSIC_CONTROL_STATE = ("state", "steps_beyond_terminated", "last_u")


def _as_data(value):
    """NumPy arrays and scalars as tensors (dtype kept), sequences element-wise; other values as they are."""
    if isinstance(value, (np.ndarray, np.generic)):
        return torch.from_numpy(np.array(value))
    if isinstance(value, (list, tuple)):
        return type(value)(_as_data(v) for v in value)
    return value


def _from_data(value):
    if isinstance(value, torch.Tensor):
        array = value.numpy()
        return array[()] if array.ndim == 0 else array
    if isinstance(value, (list, tuple)):
        return type(value)(_from_data(v) for v in value)
    return value


def _mujoco_state(base):
    import mujoco

    spec = mujoco.mjtState.mjSTATE_INTEGRATION  # time, qpos, qvel, act, warm start, controls, applied forces
    state = np.empty(mujoco.mj_stateSize(base.model, spec))
    mujoco.mj_getState(base.model, base.data, state, spec)
    return torch.from_numpy(state)


def _set_mujoco_state(base, state) -> None:
    import mujoco

    mujoco.mj_setState(base.model, base.data, state.numpy(), mujoco.mjtState.mjSTATE_INTEGRATION)


def _env_family(base) -> Optional[str]:
    module = type(base).__module__
    if module.startswith("gymnasium.envs.classic_control."):
        return "classic_control"
    if module.startswith("gymnasium.envs.mujoco.") and hasattr(base, "model") and hasattr(base, "data"):
        return "mujoco"
    return None


def _wrappers(env) -> list:
    chain = []
    while hasattr(env, "env"):
        chain.append(env)
        env = env.env
    return chain


def capture(env) -> Optional[dict]:
    """A gymnasium env's state as data, or None for a family with no state function (see `restore`)."""
    base = env.unwrapped
    family = _env_family(base)
    if family is None:
        return None
    if family == "mujoco":
        sim = _mujoco_state(base)
    else:
        sim = {name: _as_data(vars(base)[name]) for name in CLASSIC_CONTROL_STATE if name in vars(base)}
    wrappers = [{name: vars(w)[name] for name in WRAPPER_STATE if name in vars(w)} for w in _wrappers(env)]
    rng = dict(state=base.np_random.bit_generator.state, seed=base.np_random_seed)
    return dict(family=family, env=type(base).__name__, sim=sim, np_random=rng, wrappers=wrappers)


def restore(run: Run, envs: list, states: Optional[list]) -> bool:
    """Continue each env of `envs` (freshly made, same ids) from its `capture`d state; True if all could be.

    False when the family has no state function (or the checkpoint holds no env state): rank 0 says so once,
    and the script resets its envs with seeds no earlier attempt used, as the Atari scripts do.
    """
    if states is None or any(state is None for state in states):
        if run.is_main:
            print(
                f"  {type(envs[0].unwrapped).__name__}: no saved env state (no state function for this env family): "
                "the envs start new episodes, with seeds no earlier attempt used",
                flush=True,
            )
        return False
    for env, state in zip(envs, states, strict=True):
        base = env.unwrapped
        if state["family"] == "mujoco":
            _set_mujoco_state(base, state["sim"])
        else:
            for name, value in state["sim"].items():
                setattr(base, name, _from_data(value))
        base.np_random.bit_generator.state = state["np_random"]["state"]
        base._np_random_seed = state["np_random"]["seed"]
        for wrapper, saved in zip(_wrappers(env), state["wrappers"], strict=True):
            for name, value in saved.items():
                setattr(wrapper, name, value)
    return True


def split_for_rank(run: Run, ckpt: dict):
    """Join the checkpoint's per-rank state (`rank_state`) of every old rank and return this rank's part.

    Each rank saved a tuple of per-env sequences (lists, arrays or tensors, one entry per env, in env
    order). They are joined in global env order and split again for this world size, so every env
    continues exactly where it was, whichever rank steps it now. None when the ranks saved none.
    """
    saved = ckpt["rank_state"]
    if any(state is None for state in saved):
        return None
    share = []
    for parts in zip(*saved, strict=True):  # one field (envs, observations, ...) of every old rank
        if isinstance(parts[0], torch.Tensor):
            joined = torch.cat(parts)
        elif isinstance(parts[0], np.ndarray):
            joined = np.concatenate(parts)
        else:
            joined = [item for part in parts for item in part]
        local = len(joined) // run.world_size
        share.append(joined[run.rank * local : (run.rank + 1) * local])
    return tuple(share)
