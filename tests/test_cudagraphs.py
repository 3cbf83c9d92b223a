"""--cudagraphs on the CPU (docs/correctness.md, `--cudagraphs`): cleanrl_ddp/graphs.py's pieces (the one rule that
cuts an update at its collectives, the learning rate a graph reads, SAC's and TD3's Polyak update as one foreach
lerp), and each script's real main() at world size 1 with every function it would capture recorded by
tests/graph_capture.py (no host read, no collective, no tensor made anew between calls, nothing the graph needs made
inside the capture or moved after it), its final checkpoint bitwise the eager run's. The 2-rank runs are in the unit
launch of tests/test_distributed_correctness.py."""

import json
import subprocess
import sys
import types

import pytest
import torch
from dist_worker import SCRIPTS
from graph_capture import differences
from helpers import REPO
from torch.utils._python_dispatch import TorchDispatchMode

from cleanrl_ddp import graphs
from cleanrl_ddp import sac_continuous_action_multigpu as sac
from cleanrl_ddp import td3_continuous_action_multigpu as td3

CAPTURED = [s for s, spec in SCRIPTS.items() if spec.captured]


def test_graphed_is_the_function_itself_when_not_capturing():
    def f(x):
        return x + 1

    assert graphs.graphed(f, False) is f  # the scripts pass --cudagraphs and CUDA: False on the CPU


def test_optimizer_keeps_its_learning_rate_tensor_and_saves_plain_checkpoints():
    """With the flag the learning rate is a float32 tensor that `set_lr` writes in place; a checkpoint holds a float
    and `capturable` False (as an eager run's), and loading any checkpoint keeps this optimizer's tensor."""
    w = torch.nn.Parameter(torch.ones(3))
    eager = graphs.optimizer(torch.optim.Adam, [w], 1e-3, False, torch.device("cpu"), fused=True)
    opt = graphs.optimizer(torch.optim.Adam, [w], 1e-3, True, torch.device("cpu"), fused=True)
    rate = opt.param_groups[0]["lr"]
    assert isinstance(rate, torch.Tensor) and rate.dtype == torch.float32
    graphs.set_lr(opt, 2.5e-4)
    graphs.set_lr(eager, 2.5e-4)
    assert opt.param_groups[0]["lr"] is rate and float(rate) == float(torch.tensor(2.5e-4))
    assert eager.param_groups[0]["lr"] == 2.5e-4
    saved = opt.state_dict()["param_groups"][0]
    assert saved["lr"] == float(torch.tensor(2.5e-4)) and saved["capturable"] is False
    assert opt.param_groups[0]["lr"] is rate  # saving changed nothing in the optimizer
    opt.load_state_dict(eager.state_dict())  # an eager run's checkpoint: its float rate, into our tensor
    assert opt.param_groups[0]["lr"] is rate and float(rate) == float(torch.tensor(2.5e-4))
    eager.load_state_dict(opt.state_dict())
    assert isinstance(eager.param_groups[0]["lr"], float)


def test_fill_copies_nothing_when_the_static_input_is_the_staging_buffer():
    staging = torch.zeros(2, 3, dtype=torch.uint8)
    static = staging.to(torch.device("cpu"))
    assert static is staging
    graphs.fill(static, [[1, 2, 3], [4, 5, 6]], staging)
    assert staging.tolist() == [[1, 2, 3], [4, 5, 6]]
    other = torch.zeros(2, 3, dtype=torch.uint8)
    graphs.fill(other, [[7, 8, 9], [1, 2, 3]], staging)
    assert other.tolist() == [[7, 8, 9], [1, 2, 3]]


def stage(calls, name, out=None):
    def run(*inputs):
        calls.append((name, *inputs))
        return out

    run.__name__ = name
    return run


def test_an_update_is_one_run_of_stages_between_its_collectives():
    """One rule cuts every update: at world size 1 it is one part (one graph); the flat all-reduce runs between the
    backward and the step; DDP all-reduces inside backward, so there the backward runs outside every graph."""
    calls, loss = [], torch.ones(2)
    backward, step, targets = stage(calls, "backward", loss), stage(calls, "step"), stage(calls, "targets")
    update = graphs.Update(False, *graphs.optimizer_step(backward, step, None, False), targets)
    assert [p.__name__ for p in update.parts] == ["backward+step+targets"]
    outputs = update(7)
    assert calls == [("backward", 7), ("step", 7), ("targets", 7)] and len(outputs) == 1 and outputs[0] is loss

    calls.clear()  # the flat all-reduce: a part on each side of it
    update = graphs.Update(False, *graphs.optimizer_step(backward, step, lambda: calls.append(("all-reduce",)), False))
    assert [getattr(p, "__name__", "outside") for p in update.parts] == ["backward", "outside", "step"]
    assert update(3) == [loss] and calls == [("backward", 3), ("all-reduce",), ("step", 3)]
    assert update.take_outside_seconds() > 0 and update.take_outside_seconds() == 0  # taken: counted afresh

    calls.clear()  # DDP: the backward outside, the step and what follows it one part
    update = graphs.Update(False, *graphs.optimizer_step(backward, step, None, True), targets)
    assert [getattr(p, "__name__", "outside") for p in update.parts] == ["outside", "step+targets"]
    assert update(5) == [loss] and calls == [("backward", 5), ("step", 5), ("targets", 5)]


def test_cudagraphs_captures_only_on_cuda_with_a_torch_that_can(monkeypatch, capsys):
    args = types.SimpleNamespace(cudagraphs=True)
    cpu, cuda = (types.SimpleNamespace(on_cuda=c, is_main=True) for c in (False, True))
    assert not graphs.enabled(args, cpu)  # the CPU runs the same functions eagerly
    assert graphs.enabled(args, cuda) and not graphs.enabled(types.SimpleNamespace(cudagraphs=False), cuda)
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")  # the default on an old torch: eager, in one line
    assert not graphs.enabled(args, cuda)
    line = "--cudagraphs: torch 2.4.1+cu121 cannot capture sampling (2.6 can): running eagerly\n"
    assert capsys.readouterr().out == line
    opt = graphs.optimizer(torch.optim.Adam, [torch.nn.Parameter(torch.ones(1))], 1e-3, True, torch.device("cpu"))
    assert opt.param_groups[0]["lr"] == 1e-3  # a plain rate: nothing reads it from a graph


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
    """SAC's and TD3's Adam (fused, capturable) loads a checkpoint of an optimizer made without `capturable` and stays
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


@pytest.fixture(scope="module")
def graphed_runs(tmp_path_factory):
    """Every script's eager and recorded --cudagraphs runs at world size 1, in one process (one start-up)."""
    runs = tmp_path_factory.mktemp("graphs")
    cmd = [sys.executable, "-m", "tests.graph_capture", str(runs), *CAPTURED]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return runs, json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", CAPTURED, ids=[s[:-3] for s in CAPTURED])
def test_graphed_functions_are_capturable_and_change_nothing(script, graphed_runs):
    """World size 1, on the CPU: the eager run, then the --cudagraphs run with every graphed function recorded."""
    spec, (runs, reports) = SCRIPTS[script], graphed_runs
    report, total, tmp_path = reports[script], spec.capture_timesteps, runs / script[:-3]
    assert report["eager_error"] is None and report["error"] is None, report
    functions = report["functions"]
    assert sorted(functions) == sorted(spec.captured["1"]), functions
    for name, entry in functions.items():
        assert entry["replays"] >= 1, (name, entry)
        problems = {k: v for k, v in entry.items() if isinstance(v, list) and v}
        assert not problems, (name, problems)
    eager, graphed = (torch.load(tmp_path / run / "checkpoint.pt", weights_only=True) for run in ("eager", "graphed"))
    assert graphed["global_step"] == eager["global_step"] == total
    assert differences(eager, graphed) == []
