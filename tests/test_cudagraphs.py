"""--cudagraphs on the CPU (docs/correctness.md, `--cudagraphs`): cleanrl_ddp/graphs.py's pieces (the learning rate a
graph reads, SAC's and TD3's Polyak update as one foreach lerp), and each script's real main() at world size 1 and
its default learning rate with every function it would capture recorded by tests/graph_capture.py (no host read, no
collective, no tensor made anew between calls, nothing the graph needs made inside the capture or moved after it),
its final checkpoint bitwise the eager run's. The 2-rank runs are in the unit launch of
tests/test_distributed_correctness.py."""

import json
import subprocess
import sys
import types

import pytest
import torch
from graph_capture import differences
from helpers import REPO
from script_specs import SCRIPTS
from torch.utils._python_dispatch import TorchDispatchMode

from cleanrl_ddp import graphs
from cleanrl_ddp import sac_continuous_action_multigpu as sac
from cleanrl_ddp import td3_continuous_action_multigpu as td3

CAPTURED = [s for s, spec in SCRIPTS.items() if spec.captured]


def test_graphed_is_the_function_itself_when_not_capturing():
    def f(x):
        return x + 1

    assert graphs.graphed(f, False) is f  # the scripts pass --cudagraphs and CUDA: False on the CPU


def test_the_learning_rate_is_a_tensor_in_every_run_and_checkpoints_hold_a_float():
    """The rate is a float32 tensor with the flag and without it (so both paths compute the same bits), written in
    place by `set_lr`; a checkpoint holds a float and `capturable` False, as a plain optimizer's, and a plain
    optimizer's checkpoint (an older run's) loads with this optimizer's tensor and the saved state kept."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = graphs.optimizer(torch.optim.Adam, [w], 1e-3, torch.device("cpu"), fused=True)
    rate = opt.param_groups[0]["lr"]
    assert isinstance(rate, torch.Tensor) and rate.dtype == torch.float32
    graphs.set_lr(opt, 2.5e-4)
    assert opt.param_groups[0]["lr"] is rate and float(rate) == float(torch.tensor(2.5e-4))
    saved = opt.state_dict()["param_groups"][0]
    assert saved["lr"] == float(torch.tensor(2.5e-4)) and saved["capturable"] is False
    assert opt.param_groups[0]["lr"] is rate  # saving changed nothing in the optimizer
    plain = torch.optim.Adam([w], lr=1e-3, fused=True)
    w.grad = torch.ones(3)
    plain.step()
    opt.load_state_dict(plain.state_dict())
    assert opt.param_groups[0]["lr"] is rate and float(rate) == float(torch.tensor(1e-3))
    assert opt.state[w]["step"].item() == 1
    plain.load_state_dict(opt.state_dict())
    assert isinstance(plain.param_groups[0]["lr"], float)
    other = plain.state_dict()
    other["state"][0]["exp_avg"] = torch.zeros(4)  # another parameter's moments: refused as it is loaded
    with pytest.raises(ValueError, match=r"optimizer state \{'exp_avg': \(4,\), 'exp_avg_sq': \(3,\)\} for a param"):
        opt.load_state_dict(other)


def test_fill_copies_nothing_when_the_static_input_is_the_staging_buffer():
    staging = torch.zeros(2, 3, dtype=torch.uint8)
    static = staging.to(torch.device("cpu"))
    assert static is staging
    graphs.fill(static, [[1, 2, 3], [4, 5, 6]], staging)
    assert staging.tolist() == [[1, 2, 3], [4, 5, 6]]
    other = torch.zeros(2, 3, dtype=torch.uint8)
    graphs.fill(other, [[7, 8, 9], [1, 2, 3]], staging)
    assert other.tolist() == [[7, 8, 9], [1, 2, 3]]


def test_cudagraphs_captures_only_on_cuda_with_a_torch_that_can(monkeypatch, capsys):
    args = types.SimpleNamespace(cudagraphs=True)
    cpu, cuda = (types.SimpleNamespace(on_cuda=c, is_main=True) for c in (False, True))
    assert not graphs.enabled(args, cpu)  # the CPU runs the same functions eagerly
    assert graphs.enabled(args, cuda) and not graphs.enabled(types.SimpleNamespace(cudagraphs=False), cuda)
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")  # the default on an old torch: eager, in one line
    assert not graphs.enabled(args, cuda)
    line = "--cudagraphs: torch 2.4.1+cu121 cannot capture sampling (2.6 can): running eagerly\n"
    assert capsys.readouterr().out == line


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
