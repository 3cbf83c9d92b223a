"""Count, on the CPU, every place where a script's training loop would make the host wait for a GPU.

`count_host_syncs(script, argv)` imports a script as a module, runs its real `main()` in this process with
`argv` (one process, world size 1) and records three kinds of waits:

- **reads**: a tensor's value brought to the host: `item`, `bool`/`float`/`int`/`index` of a tensor (all
  `aten._local_scalar_dense`), `tolist`, `numpy`, `cpu`, `to("cpu")`. On the CPU the training device IS the
  host, so every tensor counts except host buffers by design: tensors made from host data without a device
  (`torch.from_numpy`, `torch.as_tensor(ndarray)`) and staging buffers made with an explicit `pin_memory=`
  (page-locked on a GPU). A `.numpy()` right after a counted `.cpu()` of the same tensor is one read. Reads
  inside `torch.optim` are not counted: the optimizers' step counters are host tensors unless `capturable`.
  Also counted as reads: ops whose CUDA kernel checks a tensor argument on the host before it runs
  (`HOST_CHECKED`: `torch.normal` with a tensor std, which `Normal.sample` calls, reads `std.min() >= 0`; seen
  under `torch.cuda.set_sync_debug_mode` on an H200, benchmark/gpu_check.py's `sync-debug`, 2026-11-26). On the
  CPU that check runs inside the kernel, where no dispatch mode sees it.
- **copies**: host data copied to the training device from pageable memory, i.e. a call whose *device
  argument* is the training device and whose source is host data: `torch.as_tensor`/`torch.tensor` of a
  NumPy array or Python data, `.to(device)` of a host tensor (made as above). Staging buffers made with
  `pin_memory=` are exempt: their copies are `non_blocking` from page-locked memory on a GPU. So are tensors
  made inside `torch.optim`, as its reads: foreach RAdam adds a `torch.tensor(1.0, device="cpu")` to its host
  step counters, which on the CPU names the training device and on a GPU copies nothing.
- **shapes**: operations whose output shape depends on the data (the host must read a count):
  `nonzero`, `masked_select`, `unique`, boolean-mask indexing and assignment.

Captured calls. Every function that `--cudagraphs` captures on a GPU (`graphs.graphed` where the script enables it,
`graphs.enabled` taken as a GPU's: the flag; eager here) is watched:
a wait of any kind while one runs belongs to the phase `captured`, counted per call, the optimizers' reads
included (a captured `step()` must keep its counters on the device), whichever phase its line would give.

Phases. Env steps (`SyncVectorEnv.step`, ALE's `AtariVectorEnv.send`, weighted by the envs stepped),
updates (`step()` of the first optimizer that steps: the critic's in SAC/TD3; any optimizer's step marks
an update's line) and logged steps (`runtime.log`) are markers. A wait inside a `runtime.py` call belongs
to the logged step (the loop calls the run plumbing on logged steps only). Any other wait belongs to
the phase of the marker that comes next after its line of `main()` in the innermost loop holding both, in
loop order (wrapping round to the loop's start): a value is read or copied for what comes next, e.g.
the actions for `envs.step`, the rewards of this env step for the next one, a replay sample for the
optimizer step after it. Only the window from the first logged step after the first update to the
last logged step is counted: set-up, the first update and the final checkpoint are left out. The counts
are per env step (all local envs stepped once), per update and per logged step, with the call sites
(script file:line) of each kind.
"""

import ast
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "cleanrl_ddp"
RUNTIME = str(SCRIPTS / "runtime.py")
SCRIPTS_DIR = str(SCRIPTS) + os.sep
OPTIM_DIR = os.path.dirname(torch.optim.__file__) + os.sep
PHASES = ("env_step", "update", "logged", "captured")

aten = torch.ops.aten
SCALAR_READS = {aten._local_scalar_dense.default}
DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}
HOST_CHECKED = {aten.normal.Tensor_Tensor, aten.normal.float_Tensor}
BOOL_INDEXED = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


@dataclass
class Counts:
    """What one run counted: waits per phase and kind, the markers, and the call sites."""

    waits: Counter = field(default_factory=Counter)  # (phase, kind) -> waits in the window
    markers: Counter = field(default_factory=Counter)  # phase -> markers in the window (env steps weighted)
    sites: dict = field(default_factory=lambda: defaultdict(Counter))  # (phase, kind) -> Counter of "file:line"

    def per(self, phase: str, kind: str = None) -> float:
        """Waits (of `kind`, or all kinds) per marker of `phase`."""
        total = sum(n for (p, k), n in self.waits.items() if p == phase and kind in (None, k))
        return total / max(self.markers[phase], 1)

    def total_per_env_step(self) -> float:
        return sum(self.waits.values()) / max(self.markers["env_step"], 1)

    def table(self) -> str:
        lines = [f"markers in the window: {dict(self.markers)}"]
        for phase in PHASES:
            kinds = {k: round(self.per(phase, k), 3) for k in ("read", "copy", "shape") if (phase, k) in self.waits}
            lines.append(f"  per {phase}: {round(self.per(phase), 3)} {kinds}")
            for kind in ("read", "copy", "shape"):
                for site, n in self.sites[(phase, kind)].most_common(6):
                    lines.append(f"    {kind:5} x{n:<5} {site}")
        lines.append(f"  all waits per env step: {round(self.total_per_env_step(), 3)}")
        return "\n".join(lines)


def _in_optimizer(frame) -> bool:
    """Whether the innermost frame outside torch's dispatch machinery is in torch.optim (host step counters)."""
    while frame is not None and not frame.f_code.co_filename.startswith((SCRIPTS_DIR, OPTIM_DIR)):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(OPTIM_DIR)


class _TensorSet:
    """Tensors by identity, held weakly (a WeakSet would compare tensors with `==`)."""

    def __init__(self):
        self.refs = {}

    def add(self, tensor: torch.Tensor) -> None:
        self.refs[id(tensor)] = weakref.ref(tensor)

    def __contains__(self, tensor) -> bool:
        ref = self.refs.get(id(tensor))
        return ref is not None and ref() is tensor


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.events = []  # ("mark", phase, weight) or ("wait", kind, sites, in_runtime)
        self.host = _TensorSet()  # host tensors by design: from host data without a device, or staging
        self.staging = _TensorSet()  # made with pin_memory=: page-locked on a GPU
        self.read_already = _TensorSet()  # a counted .cpu() result: its .numpy() is the same read
        self.quiet = 0  # inside a patched method that counted already (tolist/numpy dispatch nothing new)
        self.captured = 0  # inside a function that --cudagraphs captures
        self.first_optimizer = None
        self.main_code = None  # the script's main() code object

    def wait(self, kind: str) -> None:
        if self.quiet:
            return
        ours, frame = [], sys._getframe(1)  # the innermost frames in cleanrl_ddp, innermost first
        while frame is not None and len(ours) < 3:
            if frame.f_code.co_filename.startswith(SCRIPTS_DIR):
                ours.append((frame.f_code.co_filename, frame.f_lineno))
            frame = frame.f_back
        in_runtime = bool(ours) and ours[0][0] == RUNTIME
        sites = [f"{os.path.relpath(name, REPO)}:{line}" for name, line in ours]
        where = " <- ".join(sites) or "(outside cleanrl_ddp)"
        if self.captured:
            where = f"captured: {where}"
        self.events.append(("wait", kind, where, in_runtime and not self.captured, self.main_line(sys._getframe(1))))

    def mark(self, phase: str, weight: float, counted: bool = True) -> None:
        self.events.append(("mark", phase, weight if counted else 0, self.main_line(sys._getframe(1))))

    def main_line(self, frame):
        """The line of the script's `main()` that is running (None outside it)."""
        while frame is not None and frame.f_code is not self.main_code:
            frame = frame.f_back
        return frame.f_lineno if frame is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SCALAR_READS:
            if self.captured or not _in_optimizer(sys._getframe(1)):
                self.wait("read")
        elif func in HOST_CHECKED:
            self.wait("read")
        elif func in DATA_DEPENDENT:
            self.wait("shape")
        elif func in BOOL_INDEXED:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                self.wait("shape")
        return func(*args, **kwargs)


def _device_of(args, kwargs):
    """The device named by a `.to(...)`/factory call, if any."""
    device = kwargs.get("device")
    if device is None:
        for a in args:
            if isinstance(a, (str, torch.device)):
                device = a
                break
            if isinstance(a, torch.Tensor):
                device = a.device
                break
    return torch.device(device) if device is not None else None


def _patches(rec: _Recorder, device: torch.device):
    """(owner, name, replacement) of every function the recorder wraps."""
    T = torch.Tensor
    orig = {name: getattr(T, name) for name in ("tolist", "numpy", "cpu", "to", "pin_memory")}
    orig_torch = {name: getattr(torch, name) for name in ("as_tensor", "tensor", "from_numpy", "empty", "zeros")}

    def read_method(name):
        def wrapper(self, *args, **kwargs):
            if self not in rec.host and self not in rec.staging and self not in rec.read_already:
                rec.wait("read")
            rec.quiet += 1
            try:
                out = orig[name](self, *args, **kwargs)
            finally:
                rec.quiet -= 1
            if name == "cpu" and isinstance(out, torch.Tensor):
                rec.read_already.add(out)
            return out

        return wrapper

    def to(self, *args, **kwargs):
        target = _device_of(args, kwargs)
        if target is not None and target.type == "cpu" and self.device.type != "cpu":  # a GPU run
            rec.wait("read")
        elif target == device and self in rec.host and self not in rec.staging and not self.is_pinned():
            rec.wait("copy")
        return orig["to"](self, *args, **kwargs)

    def pin_memory(self, *args, **kwargs):
        out = orig["pin_memory"](self, *args, **kwargs)
        rec.staging.add(out)
        return out

    def from_host(name):
        def wrapper(data, *args, **kwargs):
            target = kwargs.get("device")
            if isinstance(data, torch.Tensor):
                if target is not None and torch.device(target) == device and data in rec.host:
                    rec.wait("copy")
                return orig_torch[name](data, *args, **kwargs)
            if target is not None and torch.device(target) == device:
                if rec.captured or not _in_optimizer(sys._getframe(1)):
                    rec.wait("copy")
                return orig_torch[name](data, *args, **kwargs)
            out = orig_torch[name](data, *args, **kwargs)
            rec.host.add(out)
            return out

        return wrapper

    def from_numpy(array):
        out = orig_torch["from_numpy"](array)
        rec.host.add(out)
        return out

    def factory(name):
        def wrapper(*args, **kwargs):
            out = orig_torch[name](*args, **kwargs)
            if "pin_memory" in kwargs:  # a staging buffer by design (page-locked on a GPU)
                rec.staging.add(out)
            return out

        return wrapper

    def sync_step(self, actions):
        rec.mark("env_step", self.num_envs)
        return orig_sync_step(self, actions)

    def atari_send(self, actions):
        rec.mark("env_step", len(actions))
        return orig_atari_send(self, actions)

    def log(*args, **kwargs):
        rec.mark("logged", 1)
        return orig_log(*args, **kwargs)

    def graphed(fn, enabled):
        if not enabled:
            return fn

        def captured(*args, **kwargs):
            rec.events.append(("call",))
            rec.captured += 1
            try:
                return fn(*args, **kwargs)
            finally:
                rec.captured -= 1

        return captured

    from ale_py.vector_env import AtariVectorEnv

    from cleanrl_ddp import graphs
    from cleanrl_ddp import runtime as rt

    orig_sync_step, orig_atari_send, orig_log = gym.vector.SyncVectorEnv.step, AtariVectorEnv.send, rt.log
    return [
        *[(T, name, read_method(name)) for name in ("tolist", "numpy", "cpu")],
        (T, "to", to),
        (T, "pin_memory", pin_memory),
        *[(torch, name, from_host(name)) for name in ("as_tensor", "tensor")],
        (torch, "from_numpy", from_numpy),
        *[(torch, name, factory(name)) for name in ("empty", "zeros")],
        (gym.vector.SyncVectorEnv, "step", sync_step),
        (AtariVectorEnv, "send", atari_send),
        (rt, "log", log),
        (graphs, "graphed", graphed),
        (graphs, "enabled", lambda args, run: args.cudagraphs),  # as on a GPU: what the script would capture there
    ]


def import_script(script: str):
    """The script file as a fresh module (its `main()` ends by returning: `exit_codes` runs only under __main__)."""
    path = SCRIPTS / script
    spec = importlib.util.spec_from_file_location(f"host_syncs_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def count_host_syncs(script: str, argv: list, local_num_envs: int) -> Counts:
    """Run `script`'s main() here with `argv` (world size 1, CPU) and count its waits (see the module docstring)."""
    mod = import_script(script)
    rec = _Recorder()
    rec.main_code = mod.main.__code__
    device = torch.device("cpu")

    def on_optimizer_step(optimizer, args, kwargs):
        rec.first_optimizer = rec.first_optimizer or weakref.ref(optimizer)
        rec.mark("update", 1, counted=rec.first_optimizer() is optimizer)

    patches = _patches(rec, device)
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    saved_argv, threads = sys.argv, torch.get_num_threads()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    hook = register_optimizer_step_post_hook(on_optimizer_step)
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        sys.argv = [script, *map(str, argv)]
        with rec:
            mod.main()
    finally:
        hook.remove()
        for owner, name, original in saved:
            setattr(owner, name, original)
        sys.argv = saved_argv
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():  # rt.start installed the run's preemption handlers
            signal.signal(sig, handler)
    return _attribute(rec.events, local_num_envs, _loops(mod.main))


def _loops(main) -> list:
    """(first line, last line) of every loop in `main`, innermost (shortest) first."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(main)))
    offset = main.__code__.co_firstlineno - 1
    spans = [(n.lineno + offset, n.end_lineno + offset) for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While))]
    return sorted(spans, key=lambda span: span[1] - span[0])


def _phase_by_line(line, marker_lines: dict, loops: list):
    """The phase of the next marker after `line` in the innermost loop of main() that holds it and a marker,
    in the loop's order (wrapping round to the loop's start): what the wait is for."""
    for first, last in loops:
        if first <= line <= last:
            inside = sorted(m for m in marker_lines if first <= m <= last)
            if inside:
                return marker_lines[next((m for m in inside if m >= line), inside[0])]
    return None


def _attribute(events: list, local_num_envs: int, loops: list) -> Counts:
    """Phases for the waits of the counted window (see the module docstring)."""
    marks = [i for i, e in enumerate(events) if e[0] == "mark"]
    first_update = next((i for i in marks if events[i][1] == "update"), None)
    logs = [i for i in marks if events[i][1] == "logged" and first_update is not None and i > first_update]
    if len(logs) < 2:
        raise AssertionError(f"fewer than two logged steps after the first update ({len(logs)}): run it longer")
    marker_lines = {e[3]: e[1] for e in (events[i] for i in marks) if e[3] is not None}
    start, end = logs[0], logs[-1]
    counts = Counts()
    window_marks = [i for i in marks if start < i <= end]
    for i in window_marks:
        counts.markers[events[i][1]] += events[i][2]
    counts.markers["env_step"] /= local_num_envs
    j = 0  # index into window_marks of the next marker in time
    for i in range(start + 1, end + 1):
        event = events[i]
        if event[0] == "mark":
            j += 1
            continue
        if event[0] == "call":
            counts.markers["captured"] += 1
            continue
        _, kind, site, in_runtime, line = event
        phase = "captured" if site.startswith("captured: ") else None
        phase = phase or ("logged" if in_runtime else _phase_by_line(line, marker_lines, loops))
        phase = phase or events[window_marks[j]][1]  # outside main's loops: the next marker in time
        counts.waits[(phase, kind)] += 1
        counts.sites[(phase, kind)][site] += 1
    return counts


def count_in_subprocess(runs: dict, timeout: float = 900) -> dict:
    """`count_host_syncs` of several scripts in one fresh interpreter, one after the other (one start-up): a script's
    threads (ALE's) and global state stay out of pytest's. `runs`: {script: (local_num_envs, argv)}; returns
    {script: Counts, or the text of the error its run raised}."""
    cmd = [sys.executable, "-m", "tests.host_syncs", "--json", json.dumps(runs, default=str)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}  # counts do not depend on threads
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    results = {}
    for script, data in json.loads(proc.stdout.splitlines()[-1]).items():
        if isinstance(data, str):
            results[script] = data
            continue
        counts = results[script] = Counts(markers=Counter(data["markers"]))
        for key, n in data["waits"].items():
            counts.waits[tuple(key.split("/"))] = n
        for key, sites in data["sites"].items():
            counts.sites[tuple(key.split("/"))] = Counter(sites)
    return results


def as_json(counts: Counts) -> dict:
    waits = {"/".join(key): n for key, n in counts.waits.items()}
    return dict(markers=counts.markers, waits=waits, sites={"/".join(key): dict(c) for key, c in counts.sites.items()})


if __name__ == "__main__":
    # python -m tests.host_syncs SCRIPT LOCAL_NUM_ENVS [flags...]: the counts as JSON;
    # python -m tests.host_syncs --json '{"SCRIPT": [LOCAL_NUM_ENVS, [flags...]], ...}': each script's, or its error
    if sys.argv[1] != "--json":
        print(json.dumps(as_json(count_host_syncs(sys.argv[1], sys.argv[3:], int(sys.argv[2])))))
    else:
        import traceback

        results = {}
        for script, (local_num_envs, argv) in json.loads(sys.argv[2]).items():
            try:
                results[script] = as_json(count_host_syncs(script, argv, local_num_envs))
            except BaseException:  # noqa: B036 (a script's SystemExit too): reported with its script
                results[script] = traceback.format_exc()
        print(json.dumps(results))
