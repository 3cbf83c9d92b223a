"""`unit`'s comparisons of updates (tests/dist_worker.py), on its 2 ranks: each script's own network and update
(PPO: ppo_loss and all_reduce_gradients_flat; DQN, PQN: update_q_network; SAC, TD3: their losses and soft_update)
and the run module's check_replicas_in_sync, a distributed update against the single-process one on the union of
the local minibatches; each returns what tests/test_distributed_correctness.py asserts on, as a dict."""

import copy
import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch
from script_specs import SCRIPTS

from cleanrl_ddp.runtime import RunError, check_replicas_in_sync


def flat_params(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]).clone()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def import_script(script_path: str):
    """The very file under test as a module (not whatever `cleanrl_ddp` package is installed)."""
    module_spec = importlib.util.spec_from_file_location(Path(script_path).stem, script_path)
    mod = sys.modules[module_spec.name] = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(mod)
    return mod


def ppo_batch(mod, spec, agent0, n, g):
    """A PPO global batch in ppo_loss's order: ratios != 1 (clipping is exercised), advantages not yet normalised."""
    obs = spec.make_obs(n, g)
    with torch.no_grad():
        actions, logprobs, _, values = agent0.get_action_and_value(obs)
    logprobs = logprobs + 0.3 * torch.randn(logprobs.shape, generator=g)
    values = values.reshape(-1)
    advantages = 2.0 * torch.randn(n, generator=g) + 0.5
    returns = values + torch.randn(n, generator=g)
    return advantages, obs, actions, logprobs, returns, values


def dqn_batch(mod, spec, agent0, n, g):
    """A DQN global batch of transitions; a quarter of them terminal."""
    actions = torch.randint(0, 4, (n,), generator=g)
    rewards = torch.randint(-1, 2, (n,), generator=g).float()
    terminated = (torch.rand(n, generator=g) < 0.25).float()
    return spec.make_obs(n, g), actions, rewards, spec.make_obs(n, g), terminated


def pqn_batch(mod, spec, agent0, n, g):
    """A PQN global batch: observations, actions, and returns wide enough that every update clips its gradient."""
    n_actions = agent0.network[-1].out_features
    return spec.make_obs(n, g), torch.randint(0, n_actions, (n,), generator=g), 30.0 * torch.randn(n, generator=g)


def unit_script(script_path: str, rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    mod = import_script(script_path)
    spec = SCRIPTS[Path(script_path).name]
    args = mod.Args()
    if not (spec.dqn or spec.pqn):
        assert args.norm_adv, "the equivalence must hold with advantage normalisation on"

    # One global batch, the same on every rank; rank r's minibatch k is slice r of global minibatch k.
    torch.manual_seed(0)
    agent0 = spec.make_agent(mod)
    local_mb, num_updates = 8, 3
    n = num_updates * world_size * local_mb
    g = torch.Generator().manual_seed(1)
    batch = (dqn_batch if spec.dqn else pqn_batch if spec.pqn else ppo_batch)(mod, spec, agent0, n, g)
    # DQN: the target network is the start's online network (as in the script), fixed during these updates
    target_network = copy.deepcopy(agent0)

    def run(grad_sync: str, distributed: bool):
        """`num_updates` updates the way the script makes them; returns (grads before clipping, final params)."""
        loss_fn = getattr(mod, "ppo_loss", None)
        agent = copy.deepcopy(agent0)
        model = DDP(agent) if distributed and grad_sync == "ddp" else agent
        if spec.dqn:  # the script's optimizer: Adam with its default eps, no gradient clipping
            optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate)
        elif spec.pqn:  # the script's optimizer: RAdam, as CleanRL's
            optimizer = torch.optim.RAdam(agent.parameters(), lr=args.learning_rate, foreach=True)
        else:
            optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
        grads = []
        if not (spec.dqn or spec.pqn):  # PPO: each minibatch's advantages normalised over its global minibatch
            adv = batch[0].view(num_updates, world_size, local_mb)
            adv = adv[:, rank] if distributed else adv.reshape(num_updates, -1)
            advantages = mod.normalize_advantages(adv, world_size if distributed else 1)
        for k in range(num_updates):
            rows = slice(k * world_size * local_mb, (k + 1) * world_size * local_mb)  # the global minibatch
            if distributed:
                start = k * world_size * local_mb + rank * local_mb
                rows = slice(start, start + local_mb)
            minibatch = (t[rows] for t in batch)
            if spec.dqn:  # the script's own update function; the gradients as its optimizer step sees them
                data = dict(zip(("obs", "actions", "rewards", "next_obs", "terminated"), minibatch, strict=True))
                run_args, ws = dataclasses.replace(args, grad_sync=grad_sync), world_size if distributed else 1
                hook = optimizer.register_step_pre_hook(record_grads(grads))
                mod.update_q_network(data, model, agent, target_network, optimizer, run_args, ws)
                hook.remove()
                continue
            if spec.pqn:  # the script's own update (flat all-reduce, clipping); the gradients its RAdam step sees
                hook = optimizer.register_step_pre_hook(record_grads(grads))
                run_args, ws = dataclasses.replace(args, grad_sync=grad_sync), world_size if distributed else 1
                mod.update_q_network(model, agent, optimizer, *minibatch, run_args, ws)
                hook.remove()
                continue
            loss, _ = loss_fn(model, advantages[k], *(t[rows] for t in batch[1:]), args)
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            if distributed and grad_sync == "flat":
                mod.all_reduce_gradients_flat(list(agent.parameters()), world_size)
            grads.append(flat_params(p.grad for p in agent.parameters()))
            torch.nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
        return grads, flat_params(agent.parameters()), agent, optimizer

    ref_grads, ref_params, _, _ = run("ddp", distributed=False)
    start = flat_params(agent0.parameters())
    out = dict(script=spec.script, rank=rank, world_size=world_size)
    finals = {}
    for grad_sync in ("ddp", "flat"):
        grads, params, agent, optimizer = run(grad_sync, distributed=True)
        finals[grad_sync] = params
        out[f"{grad_sync}_grad_rel_err"] = [rel_err(a, b) for a, b in zip(grads, ref_grads, strict=True)]
        # compare the change made by the updates, not the parameters (which barely move)
        out[f"{grad_sync}_update_rel_err"] = rel_err(params - start, ref_params - start)
        out[f"{grad_sync}_moved"] = float((ref_params - start).norm())
    out["ddp_vs_flat_update_rel_err"] = rel_err(finals["ddp"] - start, finals["flat"] - start)
    if spec.pqn:  # the updates whose (single-process) gradient was clipped to --max-grad-norm
        out["clipped_updates"] = sum(abs(float(g.norm()) / args.max_grad_norm - 1) < 1e-4 for g in ref_grads)
    out["ddp_vs_flat_max_abs_diff"] = float((finals["ddp"] - finals["flat"]).abs().max())

    # --sync-check-every: in-sync replicas pass; one ulp of one parameter, or of Adam's state, on rank 1 is caught
    # (DQN: also one ulp of the target network, which the script checks together with the online network).
    replicas = agent
    nudged = [("param", next(agent.parameters()).data)]
    if spec.dqn:
        replicas = torch.nn.ModuleDict(dict(q_network=agent, target_network=target_network))
        nudged.append(("target", next(target_network.parameters()).data))
    nudged.append(("exp_avg", optimizer.state[next(agent.parameters())]["exp_avg"]))

    def sync_check_message():
        try:
            check_replicas_in_sync("iteration 7", world_size, replicas, optimizer)
        except RunError as e:
            return str(e)
        return None

    out["sync_check_in_sync"] = sync_check_message()
    for name, tensor in nudged:
        saved = tensor.clone()
        if rank == 1:
            first = (0,) * tensor.dim()
            tensor[first] = torch.nextafter(tensor[first], torch.tensor(float("inf")))
        out[f"sync_check_{name}_nudged"] = sync_check_message()
        tensor.copy_(saved)
    out["sync_check_restored"] = sync_check_message()
    return out


def unit_sac(script_path: str, rank: int, world_size: int) -> dict:
    """SAC's updates on 2 ranks (DDP and flat) against one process on the union of the local minibatches.

    The script's losses (critic_loss, policy_loss, temperature_loss), soft_update and all_reduce_gradients_flat, in
    the order of its main()'s update functions: a critic update; after every `policy_frequency`-th one that many
    actor and temperature updates; then the Polyak update of the target critics. The actor's Gaussian noise is a
    fixed table indexed by (actor call, sample id), the id carried in observation feature 0, so both sides draw the
    same noise per sample.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    mod = import_script(script_path)
    spec, args = SCRIPTS[Path(script_path).name], mod.Args()
    assert args.autotune and args.policy_frequency == 2 and args.target_network_frequency == 1

    torch.manual_seed(0)
    actor0, qf0 = spec.make_agent(mod), mod.TwinQ(11, 3)
    local_mb, num_updates, action_dim = 8, 4, 3
    n = num_updates * world_size * local_mb
    g = torch.Generator().manual_seed(1)
    obs, next_obs = spec.make_obs(n, g), spec.make_obs(n, g)
    obs[:, 0], next_obs[:, 0] = torch.arange(n) / n, (torch.arange(n) + n) / n  # sample ids (observed as data)
    batch = dict(obs=obs, actions=torch.rand(n, action_dim, generator=g) * 2 - 1, rewards=torch.randn(n, generator=g))
    batch |= dict(next_obs=next_obs, terminations=(torch.rand(n, generator=g) < 0.25).float())
    noise_table = torch.randn(64, 2 * n, action_dim, generator=g)
    calls, real_randn = [0], torch.randn
    last_input = []

    def stash_input(module, inputs):
        last_input[:] = [inputs[0]]

    def table_randn(shape, generator=None, device=None):
        ids = torch.round(last_input[0][:, 0] * n).long()
        calls[0] += 1
        return noise_table[calls[0] - 1, ids].reshape(shape)

    def run(grad_sync: str, distributed: bool):
        actor, qf = copy.deepcopy(actor0), copy.deepcopy(qf0)
        qf_target = copy.deepcopy(qf0)
        hook = actor.register_forward_pre_hook(stash_input)
        ddp = distributed and grad_sync == "ddp"
        actor_model = DDP(actor, broadcast_buffers=False) if ddp else actor
        qf_model = DDP(qf) if ddp else qf
        q_optimizer = torch.optim.Adam(qf.parameters(), lr=args.q_lr)
        actor_optimizer = torch.optim.Adam(actor.parameters(), lr=args.policy_lr)
        log_alpha = torch.zeros(1, requires_grad=True)
        a_optimizer = torch.optim.Adam([log_alpha], lr=args.q_lr)
        alpha, ws = log_alpha.detach().exp(), world_size if distributed else 1
        grads = dict(qf=[], actor=[], log_alpha=[])
        losses = (mod.critic_loss, mod.policy_loss, mod.temperature_loss)
        for name, opt in (("qf", q_optimizer), ("actor", actor_optimizer), ("log_alpha", a_optimizer)):
            opt.register_step_pre_hook(record_grads(grads[name]))  # its (averaged) gradients, as its step sees them
        calls[0] = 0
        flat = distributed and grad_sync == "flat"

        def step(optimizer, loss, params):  # as main()'s update functions: backward, the flat all-reduce, step
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            if flat or params == [log_alpha]:  # log_alpha is in no DDP wrapper: averaged by hand on both paths
                mod.all_reduce_gradients_flat(params, ws)
            optimizer.step()

        for k in range(num_updates):
            start = k * world_size * local_mb + (rank * local_mb if distributed else 0)
            rows = slice(start, start + (local_mb if distributed else world_size * local_mb))
            data = {key: t[rows] for key, t in batch.items()}
            *_, qf1_loss, qf2_loss = losses[0](qf_model, qf_target, actor, **data, alpha=alpha, gamma=args.gamma)
            step(q_optimizer, qf1_loss + qf2_loss, list(qf.parameters()))
            if (k + 1) % args.policy_frequency == 0:
                for _ in range(args.policy_frequency):
                    qf.requires_grad_(False)  # as main(): the critics frozen in the actor's loss
                    actor_loss = losses[1](actor_model, qf, data["obs"], alpha)
                    qf.requires_grad_(True)
                    step(actor_optimizer, actor_loss, list(actor.parameters()))
                    alpha_loss = losses[2](actor, log_alpha, data["obs"], -float(action_dim))
                    step(a_optimizer, alpha_loss, [log_alpha])
                    with torch.no_grad():
                        alpha.copy_(log_alpha.exp())
            mod.soft_update([qf], [qf_target], args.tau)
        hook.remove()
        final = dict(qf=flat_params(qf.parameters()), actor=flat_params(actor.parameters()))
        final |= dict(log_alpha=log_alpha.detach().clone(), qf_target=flat_params(qf_target.parameters()))
        return grads, final

    torch.randn = table_randn
    try:
        ref_grads, ref_final = run("ddp", distributed=False)
        start = dict(qf=flat_params(qf0.parameters()), actor=flat_params(actor0.parameters()))
        start |= dict(log_alpha=torch.zeros(1), qf_target=start["qf"])
        out = dict(script=spec.script, rank=rank, world_size=world_size, noise_calls=calls[0])
        out |= compare_with_single_process(run, (ref_grads, ref_final), start, ("qf", "actor", "log_alpha"))
    finally:
        torch.randn = real_randn
    return out


def unit_td3(script_path: str, rank: int, world_size: int) -> dict:
    """TD3's updates on 2 ranks (DDP and flat) against one process on the union of the local minibatches.

    The script's losses (critic_loss, policy_loss), soft_update and all_reduce_gradients_flat, in the order of its
    main()'s update functions: a critic update; after every `policy_frequency`-th one an actor update with the
    Polyak update of the target actor and critics. The target policy smoothing noise is a fixed table indexed by the
    transition's row in the global batch, so both sides draw the same noise for the same transition.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    mod = import_script(script_path)
    spec, args = SCRIPTS[Path(script_path).name], mod.Args()
    assert args.policy_frequency == 2

    torch.manual_seed(0)
    actor0, qf0 = spec.make_agent(mod), mod.TwinQ(11, 3)
    local_mb, num_updates, action_dim = 8, 4, 3
    n = num_updates * world_size * local_mb
    g = torch.Generator().manual_seed(1)
    batch = dict(obs=spec.make_obs(n, g), actions=torch.rand(n, action_dim, generator=g) * 2 - 1)
    batch |= dict(rewards=torch.randn(n, generator=g), next_obs=spec.make_obs(n, g))
    batch |= dict(terminations=(torch.rand(n, generator=g) < 0.25).float())
    noise_table = 2.0 * torch.randn(n, action_dim, generator=g)  # wide: the clip to --noise-clip is exercised
    rows, calls, real_randn = [slice(0)], [0], torch.randn

    def table_randn(shape, generator=None, device=None):
        calls[0] += 1
        return noise_table[rows[0]].reshape(shape)

    def run(grad_sync: str, distributed: bool):
        actor, qf = copy.deepcopy(actor0), copy.deepcopy(qf0)
        target_actor, qf_target = copy.deepcopy(actor0), copy.deepcopy(qf0)
        ddp = distributed and grad_sync == "ddp"
        actor_model = DDP(actor, broadcast_buffers=False) if ddp else actor
        qf_model = DDP(qf) if ddp else qf
        q_optimizer = torch.optim.Adam(qf.parameters(), lr=args.learning_rate)
        actor_optimizer = torch.optim.Adam(actor.parameters(), lr=args.learning_rate)
        ws = world_size if distributed else 1
        grads = dict(qf=[], actor=[])
        critic_loss, policy_loss = mod.critic_loss, mod.policy_loss
        for name, opt in (("qf", q_optimizer), ("actor", actor_optimizer)):
            opt.register_step_pre_hook(record_grads(grads[name]))  # its (averaged) gradients, as its step sees them
        calls[0] = 0

        def step(optimizer, loss, params):  # as main()'s update functions: backward, the flat all-reduce, step
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            if distributed and grad_sync == "flat":
                mod.all_reduce_gradients_flat(params, ws)
            optimizer.step()

        for k in range(num_updates):
            start = k * world_size * local_mb + (rank * local_mb if distributed else 0)
            rows[0] = slice(start, start + (local_mb if distributed else world_size * local_mb))
            data = {key: t[rows[0]] for key, t in batch.items()}
            *_, qf1_loss, qf2_loss = critic_loss(qf_model, qf_target, target_actor, **data, args=args)
            step(q_optimizer, qf1_loss + qf2_loss, list(qf.parameters()))
            if (k + 1) % args.policy_frequency == 0:  # the actor, then both target networks
                qf.requires_grad_(False)  # as main(): the critics frozen in the actor's loss
                actor_loss = policy_loss(actor_model, qf, data["obs"])
                qf.requires_grad_(True)
                step(actor_optimizer, actor_loss, list(actor.parameters()))
                mod.soft_update([actor, qf], [target_actor, qf_target], args.tau)
        final = dict(qf=flat_params(qf.parameters()), actor=flat_params(actor.parameters()))
        final |= dict(
            qf_target=flat_params(qf_target.parameters()), target_actor=flat_params(target_actor.parameters())
        )
        return grads, final

    torch.randn = table_randn
    try:
        ref_grads, ref_final = run("ddp", distributed=False)
        start = dict(qf=flat_params(qf0.parameters()), actor=flat_params(actor0.parameters()))
        start |= dict(qf_target=start["qf"], target_actor=start["actor"])
        out = dict(script=spec.script, rank=rank, world_size=world_size, noise_calls=calls[0])
        out |= compare_with_single_process(run, (ref_grads, ref_final), start, ("qf", "actor"))
    finally:
        torch.randn = real_randn
    return out


def compare_with_single_process(run, ref: tuple, start: dict, grad_names: tuple) -> dict:
    """SAC's and TD3's `run(grad_sync, distributed)` -> (gradients by name, final flat parameters by name): each
    gradient path on the ranks against the one process's `ref` (`run("ddp", False)`), and DDP against flat, as
    relative errors of the gradients and of the changes made, with how far the one process moved each."""
    (ref_grads, ref_final), out, finals = ref, {}, {}
    for grad_sync in ("ddp", "flat"):
        grads, final = run(grad_sync, distributed=True)
        finals[grad_sync] = final
        for name in grad_names:
            out[f"{grad_sync}_{name}_grad_rel_err"] = [
                rel_err(a, b) for a, b in zip(grads[name], ref_grads[name], strict=True)
            ]
        for name in final:
            change, ref_change = final[name] - start[name], ref_final[name] - start[name]
            out[f"{grad_sync}_{name}_update_rel_err"] = rel_err(change, ref_change)
            out[f"{grad_sync}_{name}_moved"] = float(ref_change.norm())
    for name in ref_final:
        out[f"ddp_vs_flat_{name}_update_rel_err"] = rel_err(
            finals["ddp"][name] - start[name], finals["flat"][name] - start[name]
        )
    return out


def record_grads(into: list):
    """An optimizer step pre-hook that appends the optimizer's gradients, flattened, to `into`."""

    def hook(optimizer, args, kwargs):
        into.append(flat_params(p.grad for group in optimizer.param_groups for p in group["params"]))

    return hook
