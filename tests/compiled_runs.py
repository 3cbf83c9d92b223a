"""`unit`'s --compile runs (tests/dist_worker.py): a script's real `main()` with --compile (`compiled_run`), each
compiled function traced as inductor does (Dynamo's graphs and graph breaks, DDP's graph splitting, AOTAutograd's
forward and backward) by a recording backend that runs the traced aten graphs, as torch's aot_eager backend does;
inductor's code generation alone is left to benchmark/gpu_check.py: it takes minutes on the 2-core CI machine
(docs/correctness.md, `--compile`)."""

import os
import re
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from unit_updates import import_script

# A collective's op in an FX graph (c10d ops, Dynamo's functional collectives, their aten ops; not broadcast_tensors),
# and the file of torch's DDP wrapper
COLLECTIVE = re.compile(r"c10d|all_?reduce|all_gather|reduce_scatter|all_to_all|broadcast(?!_tensors|_to|_shapes|_all)")
DDP_FILE = os.path.join("torch", "nn", "parallel", "distributed.py")
SCRIPTS_DIR = str(Path(__file__).resolve().parents[1] / "cleanrl_ddp")


def break_site(reason) -> str:
    """Where a graph break (Dynamo's GraphCompileReason) happened: a split of DDPOptimizer's, a break inside torch's
    DistributedDataParallel wrapper (its forward calls code that Dynamo does not trace), or the innermost frame."""
    innermost = reason.user_stack[-1] if reason.user_stack else None
    if "DDPOptimizer" in reason.reason:
        return "DDPOptimizer"
    if "DistributedDataParallel" in reason.reason or (innermost and innermost.filename.endswith(DDP_FILE)):
        return "DistributedDataParallel"
    return f"{innermost.filename}:{innermost.lineno}" if innermost else "?"


def compiled_run(script_path: str, flags: list) -> dict:
    """The real script's `main()` with `flags` and --compile, here (a rank of the `unit` launch, out of its own
    process group), each `torch.compile`d function traced by a recording backend instead of inductor: Dynamo's
    graphs, then AOTAutograd's forward and backward graphs of each (run as traced, like aot_eager). Returns per
    compiled function the graphs of each kind and its calls; every collective op found in any graph; the forward
    graphs that mutate an input (AOTAutograd's metadata); where and why each graph broke (Dynamo's
    graph_break_reasons, DDPOptimizer's splits included); every optimizer's `fused`; the gradients: missing at the
    first compiled call, or with another storage or strides at any optimizer step; and every read of a compiled
    call's output (or of a tensor sharing its memory) after the next compiled call began, where CUDA graph trees
    may have overwritten it."""
    import traceback

    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import graph_break_reasons
    from torch._functorch.aot_autograd import make_boxed_func
    from torch.fx.node import _get_qualified_name
    from torch.overrides import TorchFunctionMode, _pop_mode_temporarily
    from torch.utils._pytree import tree_leaves

    rec = dict(compiled={}, collectives=[], graph_breaks=[], fused=[], grads_missing=[], grads_moved=[])
    rec |= dict(mutated_inputs=[], grad_strides_differ=[], optimizer_steps=0, stale_reads=[], error=None)
    optimizers, grad_ptrs = [], {}
    latest, stale = [], {}  # the latest compiled call's outputs; earlier ones by storage (kept alive: never reused)

    def ops(gm):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                try:
                    yield _get_qualified_name(node.target)
                except Exception:  # a target without a module-level name
                    yield str(node.target)

    def recording_compile(fn, **kwargs):  # the script's `mode` is for inductor (CUDA graphs on CUDA): not used here
        name, graphs = fn.__name__, dict(dynamo=0, forward=0, backward=0, calls=0)
        rec["compiled"][name] = graphs

        def record(kind, gm):
            graphs[kind] += 1
            rec["collectives"] += [f"{name} {kind} graph: {op}" for op in ops(gm) if COLLECTIVE.search(op)]

        def compiler(kind):
            def compile_graph(gm, example_inputs):
                record(kind, gm)
                context = torch._guards.TracingContext.try_get()  # AOTAutograd's view of the forward's inputs
                mutated = context.fw_metadata.num_mutated_inp_runtime_indices if kind == "forward" else 0
                rec["mutated_inputs"] += [f"{name} forward graph: {mutated} input(s) mutated"] if mutated else []
                return make_boxed_func(gm.forward)

            return compile_graph

        aot = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))

        def backend(gm, example_inputs):
            record("dynamo", gm)
            return aot(gm, example_inputs)

        compiled_fn = real_compile(fn, backend=backend)

        def call(*args, **kw):
            if not any(g["calls"] for g in rec["compiled"].values()):  # the run's first compiled call
                for p in (p for o in optimizers for g in o.param_groups for p in g["params"]):
                    if p.grad is None:
                        rec["grads_missing"].append(f"{name}: a parameter of shape {list(p.shape)}")
                    else:
                        grad_ptrs[p] = p.grad.data_ptr()
            graphs["calls"] += 1
            stale.update((t.untyped_storage().data_ptr(), (call, t)) for call, t in latest if t.numel())
            with _pop_mode_temporarily():  # StaleReads watches the eager code only
                out = compiled_fn(*args, **kw)
            latest[:] = [(f"{name} call {graphs['calls']}", t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            return out

        return call

    class StaleReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            for t in tree_leaves((args, kwargs or {})):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in stale:
                    stack = traceback.extract_stack()
                    at = [f"{Path(f.filename).name}:{f.lineno}" for f in stack if f.filename.startswith(SCRIPTS_DIR)]
                    output_of = stale[t.untyped_storage().data_ptr()][0]
                    rec["stale_reads"].append(f"{func.__name__} at {(at or ['?'])[-1]}: an output of {output_of}")
            return func(*args, **(kwargs or {}))

    def recording_optimizer_init(self, *args, **kw):
        optimizer_init(self, *args, **kw)
        optimizers.append(self)

    def check_grads(optimizer, args, kwargs):
        rec["optimizer_steps"] += 1
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            where = f"optimizer step {rec['optimizer_steps']}, a parameter of shape {list(p.shape)}"
            if p.grad is None or grad_ptrs.get(p) != p.grad.data_ptr():
                rec["grads_moved"].append(where)
            elif p.grad.stride() != p.stride():
                rec["grad_strides_differ"].append(where)

    mod = import_script(script_path)
    torch._dynamo.reset()  # also empties graph_break_reasons
    real_compile, optimizer_init = torch.compile, torch.optim.Optimizer.__init__
    torch.compile, torch.optim.Optimizer.__init__ = recording_compile, recording_optimizer_init
    hook = register_optimizer_step_pre_hook(check_grads)
    sys.argv = [script_path, *map(str, flags), "--compile"]
    try:
        with StaleReads():
            mod.main()
    except BaseException:
        rec["error"] = traceback.format_exc()
    finally:
        hook.remove()
        torch.compile, torch.optim.Optimizer.__init__ = real_compile, optimizer_init
    rec["graph_breaks"] = [(break_site(r), r.reason.splitlines()[0]) for r in graph_break_reasons]
    rec["fused"] = [bool(o.defaults.get("fused")) for o in optimizers]
    return rec
