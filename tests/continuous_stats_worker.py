"""Run under torchrun by tests/test_ppo_continuous_action_multigpu.py: merge normalisation statistics.

Every rank draws its own samples (different counts, means and scales per rank) for a few iterations and
merges them with `RunningStats.update`, as the script does once per iteration. After every iteration the
ranks' statistics are gathered; rank 0 writes, to the JSON file named by argv[1], whether they were
bit-identical and the largest relative error against numpy over the samples of all ranks so far.
"""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from cleanrl_ddp.ppo_continuous_action_multigpu import RunningStats

ITERATIONS = 4

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(1000 + rank)
    obs_stats, return_stats = RunningStats((3,)), RunningStats(())
    seen_obs, seen_returns = [], []  # every rank's samples (rank 0 keeps them for the reference)
    identical, max_rel_error, counts = True, 0.0, []
    for it in range(ITERATIONS):
        n = 50 + 17 * rank + 5 * it  # unequal batches across ranks and iterations
        obs = rng.normal(loc=[3.0 + rank, -2.0, 0.5 * it], scale=[1.0, 0.1 + rank, 2.0], size=(n, 3))
        returns = rng.normal(loc=10.0 * rank, scale=5.0, size=(n,))
        obs_stats.update(torch.as_tensor(obs), world_size)
        return_stats.update(torch.as_tensor(returns), world_size)

        mine = [t.clone() for t in obs_stats.tensors() + return_stats.tensors()]
        all_stats, all_samples = [None] * world_size, [None] * world_size
        dist.all_gather_object(all_stats, mine)
        dist.all_gather_object(all_samples, (obs, returns))
        identical &= all(all(torch.equal(a, b) for a, b in zip(s, all_stats[0], strict=True)) for s in all_stats)
        seen_obs += [o for o, _ in all_samples]
        seen_returns += [r for _, r in all_samples]
        ref_obs, ref_returns = np.concatenate(seen_obs), np.concatenate(seen_returns)
        for stats, ref in ((obs_stats, ref_obs), (return_stats, ref_returns)):
            assert stats.count.item() == len(ref), (stats.count.item(), len(ref))
            for got, want in ((stats.mean.numpy(), ref.mean(0)), (stats.var.numpy(), ref.var(0))):
                max_rel_error = max(max_rel_error, float(np.max(np.abs(got - want) / np.abs(want))))
        counts.append(obs_stats.count.item())

    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(dict(identical=identical, max_rel_error=max_rel_error, counts=counts), f)
    dist.destroy_process_group()
    os._exit(0)  # as the scripts do: no interpreter finalization, where gloo's threads can abort
