"""--cudagraphs on the CPU (docs/correctness.md, `--cudagraphs`): cleanrl_ddp/graphs.py's pieces, and each script's real
main() at world size 1 with every function it would capture recorded by tests/graph_capture.py (no host read, no
collective, no tensor made anew between calls, nothing the graph needs made inside the capture or moved after it),
its final checkpoint bitwise the eager run's. The 2-rank runs are in the unit launch of
tests/test_distributed_correctness.py."""

import json
import subprocess
import sys

import pytest
import torch
from dist_worker import SCRIPTS
from graph_capture import differences
from helpers import REPO

from cleanrl_ddp import graphs
from cleanrl_ddp.errors import RunError

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


@pytest.mark.parametrize("world_size", [1, 2])
def test_update_step_runs_backward_and_step_once_each_in_order(world_size):
    calls = []
    backward, step = lambda x: calls.append(("backward", x)) or "stats", lambda: calls.append("step")
    first, second = graphs.update_step(backward, step, False, world_size == 1, world_size)
    assert first(5) == "stats"
    # world size 1: one function (one graph) for both; else backward, then the step after the all-reduce
    assert calls == ([("backward", 5), "step"] if world_size == 1 else [("backward", 5)])
    second()
    # world size 1: `second` does nothing
    assert calls == [("backward", 5), "step"]


def test_old_torch_is_one_line(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    with pytest.raises(RunError, match=r"--cudagraphs needs torch >= 2.6 \(this is 2.4.1\+cu121\); omit it"):
        graphs.optimizer(torch.optim.Adam, [torch.nn.Parameter(torch.ones(1))], 1e-3, True, torch.device("cpu"))


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
