"""cleanrl_ddp/graphs.py (--cudagraphs) and the off-policy scripts' pieces around it, in-process and in milliseconds:
an update is one capturable run of stages at world size 1 and is cut at each all-reduce at more; --cudagraphs
refuses DDP at world size > 1 in one line; the target networks' Polyak update is one foreach lerp, equal to the
per-parameter lerp it replaced. What runs inside the captured functions: tests/test_distributed_correctness.py
(collectives, allocations) and tests/test_host_syncs.py (host waits)."""

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cleanrl_ddp import graphs
from cleanrl_ddp import sac_continuous_action_multigpu as sac
from cleanrl_ddp import td3_continuous_action_multigpu as td3


def test_an_update_is_one_run_of_stages_between_all_reduces():
    calls = []

    def stage(name, out=None):
        def run(x):
            calls.append((name, x))
            return out

        run.__name__ = name
        return run

    reduce = graphs.Outside(lambda tag: calls.append((tag, None)), "all-reduce")
    loss = torch.ones(2)
    # world size 1: no all-reduce (None), so one part, which --cudagraphs captures whole
    update = graphs.Update(False, stage("backward", loss), None, stage("step"), stage("targets"))
    assert [p.__name__ for p in update.parts] == ["backward+step+targets"]
    outputs = update(7)
    assert calls == [("backward", 7), ("step", 7), ("targets", 7)] and len(outputs) == 1 and outputs[0] is loss
    # world size > 1: a part on each side of every all-reduce, which runs between them
    calls.clear()
    update = graphs.Update(False, stage("backward", loss), reduce, stage("step"), stage("next", (loss, None)))
    assert [getattr(p, "__name__", "outside") for p in update.parts] == ["backward", "outside", "step+next"]
    assert len(update(3)) == 2 and calls == [("backward", 3), ("all-reduce", None), ("step", 3), ("next", 3)]


def test_cudagraphs_refuses_ddp_at_world_size_above_1():
    args = types.SimpleNamespace(cudagraphs=True, grad_sync="ddp")
    with pytest.raises(graphs.RunError, match="--cudagraphs at world size > 1 needs --grad-sync flat"):
        graphs.enabled(args, types.SimpleNamespace(world_size=2, on_cuda=False))
    assert not graphs.enabled(args, types.SimpleNamespace(world_size=1, on_cuda=False))  # eager on the CPU
    args.grad_sync = "flat"
    assert not graphs.enabled(args, types.SimpleNamespace(world_size=2, on_cuda=False))
    assert graphs.graphed(len, False) is len  # without --cudagraphs (or CUDA) the function itself
    with pytest.warns(UserWarning, match="without CUDA"):  # tensordict's CudaGraphModule, here a pass-through
        graph = graphs.graphed(graphs.in_order([len]), True)
    assert graph.__name__ == "len" and graph([1, 2]) == [2]


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("script", [sac, td3], ids=["sac", "td3"])
def test_target_update_is_one_foreach_lerp_equal_to_the_per_parameter_one(script):
    torch.manual_seed(0)
    nets = [script.TwinQ(11, 3), script.Actor(11, 3, [-1.0] * 3, [1.0] * 3)]
    targets = [script.TwinQ(11, 3), script.Actor(11, 3, [-1.0] * 3, [1.0] * 3)]
    expected = [p.detach().clone() for t in targets for p in t.parameters()]
    with torch.no_grad():  # the update it replaced: one lerp_ per parameter
        for e, p in zip(expected, (p for n in nets for p in n.parameters()), strict=True):
            e.lerp_(p, 0.005)
    with Ops() as mode:
        script.soft_update(nets, targets, 0.005)
    assert mode.ops == ["aten._foreach_lerp_.Scalar"]
    assert all(torch.equal(p, e) for p, e in zip((p for t in targets for p in t.parameters()), expected, strict=True))


def test_an_older_checkpoint_leaves_the_optimizers_capturable():
    """SAC's and TD3's Adam (fused, capturable) loads a checkpoint saved before issue 42 (not capturable) and stays
    capturable, as a captured step needs, with the saved state (the step count) restored."""
    param = torch.nn.Parameter(torch.ones(3))
    old = torch.optim.Adam([param], lr=1e-3, fused=True)
    param.grad = torch.ones(3)
    old.step()
    opt = torch.optim.Adam([param], lr=1e-3, fused=True, capturable=True)
    graphs.keep_capturable(opt)
    opt.load_state_dict(old.state_dict())
    assert opt.param_groups[0]["capturable"] is True
    assert opt.state[param]["step"].item() == 1
