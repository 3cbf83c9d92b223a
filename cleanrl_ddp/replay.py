"""One rank's replay memory on the training device, for SAC and TD3 (CleanRL imports SB3's `ReplayBuffer`; this
one keeps the transitions where the updates read them). Docs: docs/sac_continuous_action_multigpu.md (detail 9)."""

import numpy as np
import torch

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
        """Store one step of every env (host arrays) with one copy to the device."""
        n = len(obs)
        host = np.concatenate([obs, next_obs, actions, rewards[:, None], terminations[:, None]], axis=1)
        idx = (self.pos + torch.arange(n, device=self.rows.device)) % self.capacity
        self.rows[idx] = rt.to_device(host, self.rows.device, dtype=torch.float32)
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
