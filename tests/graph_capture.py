"""Prove on the CPU that what a script's `--cudagraphs` captures on CUDA is safe to capture, and that capturing
changes nothing.

`graphed_run(script_path, argv)` runs the script's real `main()` with `argv` and `--cudagraphs` in this process,
with `cleanrl_ddp.graphs.enabled` answering as on a GPU (the flag) and every function that the script then passes to
`cleanrl_ddp.graphs.graphed` to capture wrapped in `Recorder`: a stand-in for tensordict's `CudaGraphModule` that
keeps its data flow on the CPU and checks, call by call, what a CUDA graph would replay wrongly or not at all:

- like `CudaGraphModule`, its first `warmup - 1` calls run the function as is; the next ("capture") runs it on
  copies of its tensor arguments, kept as the static inputs; later calls ("replays") copy their arguments into
  those and run the function on them, and every call after the warm-up returns copies of the outputs;
- the capture keeps every storage the function touched alive (as the graph's memory pool would) and a replay
  may touch only those, its static inputs, and what it allocates itself: a tensor made anew between calls and
  read by the function (a graph would read the capture's tensor at its old address) fails (`unstatic`), and so
  does a replay that leaves out a tensor the capture used (the function took another path: `diverged`);
- no host read (`item`, `tolist`, `numpy`, `cpu`, and tests/host_syncs.py's data-dependent shapes and
  host-checked ops) and no collective (a c10d op, or a `torch.distributed` call) inside any call after the
  warm-up; the parameters, gradients and optimizer state a capture uses were made before it (`missing_at_capture`)
  and keep their storage at every later call (`moved`).

Run as `python -m tests.graph_capture RUNS_DIR SCRIPT [SCRIPT...]` it runs each script eagerly (run
`RUNS_DIR/<stem>/eager`), then with --cudagraphs recorded (`RUNS_DIR/<stem>/graphed`), at world size 1 with its
`capture_flags` (tests/script_specs.py's `SCRIPTS`) and seed 3, all in this one process, and prints the reports as
JSON by script; tests/captured_runs.py runs `graphed_run` on 2 ranks.
"""

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from cleanrl_ddp import graphs

REPO = Path(__file__).resolve().parents[1]
SCRIPTS_DIR = str(REPO / "cleanrl_ddp") + os.sep
aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default}
DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default}
DATA_DEPENDENT |= {aten.unique_consecutive.default, aten.repeat_interleave.Tensor, aten.nonzero_static.default}
HOST_CHECKED = {aten.normal.Tensor_Tensor, aten.normal.float_Tensor}
BOOL_INDEXED = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
DIST_CALLS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier")
DIST_CALLS += ("all_gather_object", "broadcast_object_list", "reduce", "gather", "scatter")


def site() -> str:
    """The innermost line of cleanrl_ddp running now."""
    frame = sys._getframe(1)
    while frame is not None and not frame.f_code.co_filename.startswith(SCRIPTS_DIR):
        frame = frame.f_back
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}" if frame else "?"


class Watch(TorchDispatchMode):
    """During one call of a recorded function: the storages its ops touch and make, and the ops no graph may hold."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder, self.touched, self.made = recorder, {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        name = str(func)
        if func in HOST_READS or func in HOST_CHECKED:
            self.recorder.violation("host_reads", f"{name} at {site()}")
        elif func in DATA_DEPENDENT or (func in BOOL_INDEXED and any(t.dtype == torch.bool for t in inputs[1:])):
            self.recorder.violation("host_reads", f"{name} (a data-dependent shape) at {site()}")
        if "c10d" in name:
            self.recorder.violation("collectives", f"{name} at {site()}")
        for t in inputs:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self.made and ptr not in self.touched:
                self.touched[ptr] = (storage, f"{name} at {site()}")
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.touched:
                self.made[t.untyped_storage().data_ptr()] = t.untyped_storage()
        return out


class Report:
    """What every Recorder of a run found, by function name."""

    def __init__(self):
        self.functions, self.optimizers = {}, []

    def as_dict(self) -> dict:
        return dict(functions=json.loads(json.dumps(self.functions)))  # a copy: the next run starts afresh


REPORT = Report()


def name_of_partial(fn) -> str:
    """`policy_step(h=0)` for `functools.partial(policy_step, h=0)`."""
    bound = [*map(repr, fn.args), *(f"{k}={v!r}" for k, v in fn.keywords.items())]
    return f"{fn.func.__name__}({', '.join(bound)})"


class Recorder:
    """A stand-in for `CudaGraphModule(fn, warmup)` on the CPU (see the module docstring)."""

    def __init__(self, fn, warmup: int):
        self.fn, self.warmup, self.calls = fn, warmup, 0
        self.name = fn.__name__ if hasattr(fn, "__name__") else name_of_partial(fn)
        self.static, self.kept, self.storages = None, {}, {}

    @property
    def entry(self) -> dict:
        """This function's report, made at its first call (one a run never calls is not reported)."""
        entry = REPORT.functions.setdefault(self.name, dict(calls=0, replays=0, warmup=self.warmup))
        for kind in ("host_reads", "collectives", "unstatic", "diverged", "missing_at_capture", "moved"):
            entry.setdefault(kind, [])
        return entry

    def violation(self, kind: str, what: str) -> None:
        if what not in self.entry[kind]:
            self.entry[kind].append(what)

    def tracked(self) -> dict:
        """Storage of every parameter, gradient and optimizer state tensor of every optimizer, by name."""
        out = {}
        for i, opt in enumerate(REPORT.optimizers):
            for j, p in enumerate(p for g in opt.param_groups for p in g["params"]):
                out[f"optimizer {i} parameter {j} {list(p.shape)}"] = p.untyped_storage().data_ptr()
                out[f"... its gradient {i}.{j}"] = None if p.grad is None else p.grad.untyped_storage().data_ptr()
                for key, value in opt.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"... its optimizer state {key} {i}.{j}"] = value.untyped_storage().data_ptr()
        return out

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.entry["calls"] += 1
        if self.calls < self.warmup:
            return self.fn(*args, **kwargs)
        capture = self.calls == self.warmup
        if capture:
            self.static = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
        else:
            self.entry["replays"] += 1
            leaves, spec = tree_flatten((args, kwargs))
            static_leaves, static_spec = tree_flatten(self.static)
            if spec != static_spec:
                raise ValueError(f"{self.name}: called with other arguments than at capture")
            for new, old in zip(leaves, static_leaves, strict=True):
                if isinstance(new, torch.Tensor):
                    old.copy_(new)
                elif new != old:
                    raise ValueError(f"{self.name}: a non-tensor argument changed after the capture")
        watch = Watch(self)
        calls = {name: getattr(dist, name) for name in DIST_CALLS}
        reads = {name: getattr(torch.Tensor, name) for name in ("cpu", "numpy", "tolist")}

        def forbidden(kind, name, original):
            def wrapper(*a, **kw):
                self.violation(kind, f"{name} at {site()}")
                return original(*a, **kw)

            return wrapper

        try:
            for name, original in calls.items():
                setattr(dist, name, forbidden("collectives", f"torch.distributed.{name}", original))
            for name, original in reads.items():
                setattr(torch.Tensor, name, forbidden("host_reads", f"Tensor.{name}", original))
            with watch:
                out = self.fn(*self.static[0], **self.static[1])
        finally:
            for name, original in calls.items():
                setattr(dist, name, original)
            for name, original in reads.items():
                setattr(torch.Tensor, name, original)
        if capture:  # kept alive, as the graph's memory pool keeps them: no later tensor can take their address
            self.kept = {ptr: storage for ptr, (storage, _) in watch.touched.items()} | watch.made
            # parameters, gradients and optimizer state the graph uses: made before it, and kept
            self.storages = {name: ptr for name, ptr in self.tracked().items() if ptr in self.kept}
            for name, ptr in self.storages.items():
                if ptr in watch.made:
                    self.violation("missing_at_capture", f"{name} was made inside the capture")
            self.captured = dict(watch.touched)
        else:
            for ptr, (_, where) in watch.touched.items():
                if ptr not in self.kept:
                    self.violation("unstatic", f"reads or writes a tensor that was not there at capture: {where}")
            for ptr, (_, where) in self.captured.items():
                if ptr not in watch.touched:
                    self.violation("diverged", f"the capture used a tensor that a later call did not: {where}")
        for name, ptr in self.tracked().items():
            if name in self.storages and ptr != self.storages[name]:
                self.violation("moved", f"{name}: another storage than at capture (call {self.calls})")
        leaves, spec = tree_flatten(out)
        return tree_unflatten([x.clone() if isinstance(x, torch.Tensor) else x for x in leaves], spec)


# what training changes in a checkpoint, by key: every script's networks, targets, optimizers and RNG streams
STATES = ("agent", "q_network", "target_network", "optimizer", "rng", "actor", "target_actor", "qf", "qf_target")
STATES += ("actor_optimizer", "q_optimizer", "a_optimizer", "log_alpha")


def differences(a: dict, b: dict) -> list[str]:
    """Where two checkpoints' training states (`STATES`) differ in any bit."""
    out = []
    for key in (k for k in STATES if k in a or k in b):
        leaves_a, leaves_b = tree_flatten(a.get(key))[0], tree_flatten(b.get(key))[0]
        if len(leaves_a) != len(leaves_b):
            out.append(f"{key}: {len(leaves_a)} entries against {len(leaves_b)}")
            continue
        for i, (x, y) in enumerate(zip(leaves_a, leaves_b, strict=True)):
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
            if not same:
                out.append(f"{key} entry {i}")
    return out


def recording_graphed(fn, enabled: bool):
    """`graphs.graphed` in a --cudagraphs run, on any device: a Recorder of what a CUDA device would capture."""
    return Recorder(fn, graphs.WARMUP) if enabled else fn


def import_script(script_path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"graph_capture_{Path(script_path).stem}", script_path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its Args pickle (rank 0 broadcasts them)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def recording():
    """`graphs.enabled` answering as on a GPU, `graphs.graphed` replaced by `recording_graphed`, and every optimizer
    made meanwhile noted."""
    REPORT.functions.clear()
    REPORT.optimizers.clear()
    enabled, graphed, optimizer_init = graphs.enabled, graphs.graphed, torch.optim.Optimizer.__init__

    def init(self, *args, **kwargs):
        optimizer_init(self, *args, **kwargs)
        REPORT.optimizers.append(self)

    graphs.graphed, torch.optim.Optimizer.__init__ = recording_graphed, init
    graphs.enabled = lambda args, run: args.cudagraphs  # a GPU's answer: the script then graphs what it would there
    try:
        yield REPORT
    finally:
        graphs.enabled, graphs.graphed, torch.optim.Optimizer.__init__ = enabled, graphed, optimizer_init


def run_main(script_path: str, argv: list) -> str | None:
    """The script's main() with `argv` here; the error's traceback, or None."""
    import signal

    mod = import_script(script_path)
    saved_argv, threads = sys.argv, torch.get_num_threads()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    sys.argv = [script_path, *map(str, argv)]
    try:
        mod.main()
    except BaseException:
        return traceback.format_exc()
    finally:
        sys.argv = saved_argv
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():  # rt.start installed the run's preemption handlers
            signal.signal(sig, handler)
    return None


def graphed_run(script_path: str, argv: list) -> dict:
    """main() with `argv` and --cudagraphs, every graphed function recorded; the report (module docstring)."""
    with recording() as report:
        error = run_main(script_path, [*argv, "--cudagraphs"])
    return report.as_dict() | dict(error=error)


if __name__ == "__main__":  # python -m tests.graph_capture RUNS_DIR SCRIPT [SCRIPT...]: eager, then recorded
    sys.path.insert(0, str(REPO / "tests"))
    from script_specs import SCRIPTS

    results = {}
    for name in sys.argv[2:]:
        spec, script, runs = SCRIPTS[name], str(REPO / "cleanrl_ddp" / name), Path(sys.argv[1]) / Path(name).stem
        flags = [*spec.capture_flags, "--seed", 3, "--total-timesteps", spec.capture_timesteps, "--runs-dir", runs]
        eager_error = run_main(script, [*flags, "--run-name", "eager", "--no-cudagraphs"])
        results[name] = graphed_run(script, [*flags, "--run-name", "graphed"]) | dict(eager_error=eager_error)
    print(json.dumps(results))
