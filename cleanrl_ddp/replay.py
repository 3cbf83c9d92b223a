"""One rank's replay memory (CleanRL imports SB3's `ReplayBuffer`): SAC's and TD3's on the training device, where the
updates read it (docs/sac_continuous_action_multigpu.md, detail 9), saved in checkpoints with the envs that fill it;
DQN's Atari frames on the host, each stored once (docs/dqn_atari_multigpu.md, details 3, 4 and 9)."""

import numpy as np
import torch

from cleanrl_ddp import env_state
from cleanrl_ddp import runtime as rt


class ReplayBuffer:
    """One rank's replay memory on `device`: a ring of transitions, one float32 row each, sampled there
    from a generator of its own."""

    def __init__(self, capacity: int, obs_dim: int, action_dim: int, device, seed: int):
        self.capacity, self.pos, self.size = capacity, 0, 0
        self.widths = (obs_dim, obs_dim, action_dim, 1, 1)
        self.rows = torch.zeros((capacity, sum(self.widths)), device=device)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def add(self, obs, next_obs, actions, rewards, terminations) -> None:
        """Store one step of every env (host arrays), copied straight into the ring's next rows.

        Through a page-locked buffer on CUDA (torch's caching host allocator keeps it until its copy has run), so
        the host never waits; float32 is cast on the host. Past the ring's end the rest goes to its start."""
        n = len(obs)
        host = torch.empty((n, self.rows.shape[1]), pin_memory=self.rows.is_cuda)
        host.numpy()[...] = np.concatenate([obs, next_obs, actions, rewards[:, None], terminations[:, None]], axis=1)
        first = min(n, self.capacity - self.pos)
        self.rows[self.pos : self.pos + first].copy_(host[:first], non_blocking=True)
        self.rows[: n - first].copy_(host[first:], non_blocking=True)
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch_size: int) -> dict:
        """Uniform over the stored transitions, drawn on the device: no wait for it (the host knows `size`)."""
        idx = torch.randint(0, self.size, (batch_size,), device=self.rows.device, generator=self.generator)
        obs, next_obs, actions, rewards, terminations = self.rows[idx].split(self.widths, dim=1)
        return dict(
            obs=obs,
            actions=actions,
            rewards=rewards.view(-1),
            next_obs=next_obs,
            terminations=terminations.view(-1),
        )

    def state_dict(self) -> dict:
        """The stored transitions (the filled rows), the next row written and the sampling stream, as data."""
        rows = self.rows[: self.size].to("cpu", copy=True)  # a copy: a view would save the whole ring
        return dict(rows=rows, pos=self.pos, generator=self.generator.get_state())

    def load_state_dict(self, state: dict) -> None:
        rows = state["rows"]
        if rows.shape[1:] != self.rows.shape[1:] or len(rows) > self.capacity or not 0 <= state["pos"] < self.capacity:
            saved = f"replay rows of shape {tuple(rows.shape)} written up to {state['pos']}"
            raise ValueError(f"{saved} do not fit this ring of {tuple(self.rows.shape)}")
        self.rows[: len(rows)] = rows.to(self.rows.device)
        self.pos, self.size = state["pos"], len(rows)
        self.generator.set_state(state["generator"])


def rank_state(rb: ReplayBuffer, envs, obs: np.ndarray, episodes: rt.Episodes) -> dict:
    """This rank's part of a checkpoint: its envs as data, their observations and running episodes, its buffer."""
    envs_state = [env_state.capture(env) for env in envs.envs]
    arrays = (obs, episodes.returns, episodes.lengths)
    return dict(envs=envs_state, arrays=[torch.from_numpy(a.copy()) for a in arrays], buffer=rb.state_dict())


def resume(run, ckpt: dict, rb: ReplayBuffer, envs, episodes: rt.Episodes, obs: np.ndarray) -> np.ndarray:
    """Continue this rank's (reset) envs and its replay buffer from `ckpt`; the observations to act on next.

    They go on as saved at the same world size and buffer size. Otherwise (each rank's ring holds its own envs' steps),
    or from a checkpoint without them, or for an env family with no state function, the envs keep their reset `obs`
    and the buffer stays empty: the caller refills it.
    """
    saved, same_ring = ckpt["rank_state"], ckpt["sizes"].get("local_buffer_size") == rb.capacity
    if ckpt["world_size"] != run.world_size or not same_ring or not all(isinstance(s, dict) for s in saved):
        return obs
    mine = saved[run.rank]
    if not env_state.restore(run, envs.envs, mine["envs"]):
        return obs
    rb.load_state_dict(mine["buffer"])
    obs, episodes.returns, episodes.lengths = (a.numpy() for a in mine["arrays"])
    return obs


class FrameReplayBuffer:
    """One rank's replay memory: a ring per env, every frame stored once (uint8), stacks rebuilt when sampled.

    Slot t holds the NEWEST frame of step t's observation, its action, clipped reward and `terminated`.
    `first` marks a reset's observation; `final` a game's last, only the next_obs of the slot before it.
    """

    def __init__(self, capacity: int, num_envs: int, frame_shape=(84, 84), stack_num: int = 4):
        self.capacity, self.num_envs, self.stack_num = capacity, num_envs, stack_num
        self.frames = np.zeros((num_envs, capacity, *frame_shape), dtype=np.uint8)
        self.actions = np.zeros((num_envs, capacity), dtype=np.uint8)  # ALE has at most 18 actions
        self.rewards = np.zeros((num_envs, capacity), dtype=np.float32)
        self.terminated, self.first, self.final = (np.zeros((num_envs, capacity), dtype=bool) for _ in range(3))
        self.pos, self.size = 0, 0  # pos: the slot written next (the same for every env)

    def add(self, frame, action, reward, terminated, first, final) -> None:
        """Store one step of every env: arrays of shape [num_envs, ...]."""
        p = self.pos
        self.frames[:, p], self.actions[:, p], self.rewards[:, p] = frame, action, reward
        self.terminated[:, p], self.first[:, p], self.final[:, p] = terminated, first, final
        self.pos = (p + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def stack(self, env_idx: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """The frame stacks ending at physical `slot` of envs `env_idx`: uint8 [B, stack_num, H, W]."""
        slots = (slot[:, None] + np.arange(1 - self.stack_num, 1)) % self.capacity  # oldest .. newest
        first = self.first[env_idx[:, None], slots]
        # a frame is part of the stack unless an episode starts AFTER it (later in the stack)
        starts_at_or_after = np.flip(np.cumsum(np.flip(first, 1), 1), 1)
        keep = (starts_at_or_after - first) == 0
        return self.frames[env_idx[:, None], slots] * keep[:, :, None, None].astype(np.uint8)

    def transitions(self, env_idx: np.ndarray, slot: np.ndarray) -> dict:
        """The transitions at physical `slot` of envs `env_idx` (the caller checked they are valid)."""
        return dict(
            obs=self.stack(env_idx, slot),
            actions=self.actions[env_idx, slot].astype(np.int64),
            rewards=self.rewards[env_idx, slot],
            next_obs=self.stack(env_idx, (slot + 1) % self.capacity),
            terminated=self.terminated[env_idx, slot].astype(np.float32),
        )

    def sample(self, batch_size: int, rng=np.random) -> dict:
        """Uniform over the valid transitions (`final` slots redrawn); `rng`: a RandomState."""
        if self.size < 2:
            raise ValueError("the replay buffer needs at least two steps before sampling")
        # age 0 is the oldest slot; the newest one has no next_obs yet
        oldest = self.pos if self.size == self.capacity else 0
        low = self.stack_num - 1 if self.size == self.capacity else 0  # older stacks are overwritten
        env_idx = rng.randint(0, self.num_envs, batch_size)
        slot = (oldest + rng.randint(low, self.size - 1, batch_size)) % self.capacity
        redraw = self.final[env_idx, slot]
        while redraw.any():
            env_idx[redraw] = rng.randint(0, self.num_envs, int(redraw.sum()))
            slot[redraw] = (oldest + rng.randint(low, self.size - 1, int(redraw.sum()))) % self.capacity
            redraw = self.final[env_idx, slot]
        return self.transitions(env_idx, slot)
