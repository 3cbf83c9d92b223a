"""CUDA graphs for the scripts' `--cudagraphs` (issues 41 and 42): a function replayed as one CUDA graph instead of
dozens of kernel launches, each waiting on the host. docs/correctness.md (`--cudagraphs`) says what is captured and
how the CPU tests prove it safe to capture.

A script calls it in one line where the thing happens. The Atari scripts (issue 41):

    capture = args.cudagraphs and run.on_cuda  # only CUDA captures: on the CPU the same functions run eagerly
    policy_step = graphs.graphed(policy_step, capture)  # the rollout's step, one replay
    optimizer = graphs.optimizer(optim.Adam, agent.parameters(), args.learning_rate, args.cudagraphs, device, ...)
    graphs.set_lr(optimizer, lr)  # annealing: written into the tensor that a captured step reads
    graphs.fill(next_obs, frames, staging)  # the graph's static input, from the page-locked staging copy
    backward, step = graphs.update_step(minibatch_backward, clip_and_step, capture, model is agent, world_size)

SAC and TD3 (issue 42), whose updates are several optimizer steps each: an update is a list of stages, cut at its
gradient all-reduces (`Outside`), each run of stages between two cuts one graph (`Update`; the whole update at
world size 1):

    cudagraphs = graphs.enabled(args, run)
    update_actor = graphs.Update(cudagraphs, actor_backward, graphs.Outside(all_reduce, ...), actor_step)

Only a CUDA device captures: on the CPU `--cudagraphs` runs the same functions eagerly, in the same order, so the
CPU tests run every line but the capture itself (a value, not an error: the flag asks for speed where there is
speed to gain). A captured function replays the kernels it launched at capture on the tensors it used then, so:
- every tensor it reads is an argument (copied into the graph's static input at each call) or a buffer allocated
  once (rollout storage, parameters, gradients, optimizer state), never a tensor made anew between calls;
- it makes no host sync (no `.item()`, no data-dependent shape) and no collective (the project's rule: gradient
  all-reduces run between graphs, `update_step`, `Outside`);
- what must outlive a replay is allocated before the capture: gradients once before the loop, the optimizer's
  state by the eager warm-up calls (or the checkpoint); outputs are copies (tensordict's `CudaGraphModule`).
Random numbers stay reproducible: the CUDA generator advances by the same offsets whether a kernel is launched
eagerly or replayed (PyTorch registers the generator with the graph; each replay moves its offset on the host),
and the warm-up calls are real calls, so a resumed run continues the stream its checkpoint saved.
"""

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves

from cleanrl_ddp.errors import RunError

WARMUP = 3  # calls before the capture: 2 eager (compile, the optimizer's state), then capture and replay


def require_torch() -> None:
    """One line (RunError) when this torch cannot capture what --cudagraphs captures: sampling
    (`torch.multinomial` read its input on the host until pytorch#134818, September 2024; 2.6 is the first
    release sure to hold the fix)."""
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 6):
        raise RunError(f"--cudagraphs needs torch >= 2.6 (this is {torch.__version__}); omit it")


def graphed(fn: Callable, enabled: bool) -> Callable:
    """`fn` replayed as one CUDA graph (tensordict's `CudaGraphModule`, on the current CUDA device) when `enabled`
    (--cudagraphs on CUDA), else `fn` itself. Its first `WARMUP - 1` calls run eagerly; the next runs it and
    captures it; later calls copy their tensor arguments into the graph's static inputs and replay it, and return
    copies of its outputs. The CPU tests replace it with a recorder of every function passed here
    (tests/graph_capture.py): pass only what --cudagraphs captures."""
    if not enabled:
        return fn
    require_torch()
    from tensordict.nn import CudaGraphModule

    graph = CudaGraphModule(fn, warmup=WARMUP)
    graph.__name__ = getattr(fn, "__name__", "graph")
    return graph


def optimizer(cls, params, lr: float, enabled: bool, device: torch.device, **kwargs) -> torch.optim.Optimizer:
    """`cls(params, lr=lr, **kwargs)`. With --cudagraphs (`enabled`), on every device, its learning rate is a
    float32 tensor on `device` (what CUDA's fused Adam reads), written in place by `set_lr`, so that a captured
    step reads each iteration's rate; on CUDA it is capturable (a step on the device, no host sync).

    The rate in float32 rounds it: the run differs from an eager one by that (relative <= 6e-8 of the rate) unless
    the rate is a float32 number (2**-12 and its annealed values at a power-of-two number of iterations are:
    what the tests compare bitwise). Checkpoints are the eager ones': the saved rate is a float and not
    capturable, and loading one keeps this run's tensor (the saved param group would replace it)."""
    if not enabled:
        return cls(params, lr=lr, **kwargs)
    require_torch()
    capturable = device.type == "cuda"
    rate = torch.tensor(lr, dtype=torch.float32, device=device)
    opt = cls(params, lr=rate, capturable=capturable, **kwargs)

    def saved(opt, state_dict):
        for group in state_dict["param_groups"]:
            group.update(lr=float(group["lr"]), capturable=False)
        return state_dict

    def loaded(opt):
        for group in opt.param_groups:
            rate.fill_(float(group["lr"]))
            group.update(lr=rate, capturable=capturable)

    opt.register_state_dict_post_hook(saved)
    opt.register_load_state_dict_post_hook(loaded)
    return opt


def keep_capturable(*optimizers: torch.optim.Optimizer) -> None:
    """Each optimizer, made `capturable=True` (SAC's and TD3's: a CUDA graph may hold its step), stays so when a
    checkpoint is loaded into it: torch takes a loaded param group's hyperparameters, and checkpoints saved before
    issue 42 say `capturable=False`, with which a captured step raises. The math is the same either way."""

    def loaded(opt):
        for group in opt.param_groups:
            group["capturable"] = True

    for opt in optimizers:
        opt.register_load_state_dict_post_hook(loaded)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every param group's learning rate: written into the tensor a captured step reads (`optimizer`), else set."""
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def fill(static: torch.Tensor, array, staging: torch.Tensor) -> torch.Tensor:
    """`array` into `static`, a graph's static input on the device, through `staging` (page-locked on CUDA: the copy
    does not wait; the caller waits for the device, e.g. for the actions, before the next call overwrites it). On
    the CPU `static` may be `staging` itself (`staging.to(device)`): then nothing is copied."""
    staging.numpy()[...] = array
    return static.copy_(staging, non_blocking=True)


def update_step(
    backward: Callable, step: Callable, enabled: bool, capture_backward: bool, world_size: int
) -> tuple[Callable, Callable]:
    """The minibatch update as (first, second), called in turn with the gradient all-reduce between them.

    `backward(*inputs)` computes the loss and its gradients and returns the minibatch's stats; `step()` clips and
    steps the optimizer. At world size 1 nothing runs between them: `first` is both in one graph and `second` does
    nothing. At world size > 1 the all-reduce (a collective) stays outside every graph: `first` is `backward` in a
    graph of its own, unless `capture_backward` is False (DDP all-reduces inside backward: then it runs eagerly),
    and `second` is `step` in another."""
    if world_size == 1:

        def backward_and_step(*inputs):
            stats = backward(*inputs)
            step()
            return stats

        return graphed(backward_and_step, enabled), lambda: None
    return graphed(backward, enabled) if capture_backward else backward, graphed(step, enabled)


def enabled(args, run) -> bool:
    """Whether SAC's and TD3's --cudagraphs captures: on CUDA only (on the CPU the same functions run eagerly).
    RunError where it cannot: DDP at world size > 1 all-reduces inside backward, which a stage's graph would capture
    (the Atari scripts run that backward eagerly instead: `update_step`)."""
    if args.cudagraphs and run.world_size > 1 and args.grad_sync == "ddp":
        raise RunError("--cudagraphs at world size > 1 needs --grad-sync flat (DDP all-reduces inside backward)")
    if args.cudagraphs and run.on_cuda:
        try:
            from tensordict.nn import CudaGraphModule  # noqa: F401
        except ImportError as e:
            raise RunError(f"--cudagraphs needs tensordict's CudaGraphModule (pip install 'tensordict>=0.14'): {e}")
    return args.cudagraphs and run.on_cuda


class Outside:
    """A stage of an update that runs between CUDA graphs, never inside one: `fn(*args)`, a collective."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __call__(self, *inputs):
        self.fn(*self.args)


class Update:
    """One update as one call of its inputs: `stages` in order, each a function of the inputs or an `Outside`
    (None: nothing, e.g. no all-reduce at world size 1). A call returns the tensors the stages returned, in order.
    With `enabled` (--cudagraphs), each run of stages between two `Outside` ones is one CUDA graph (`parts`): at
    world size 1 a whole update is one replay."""

    def __init__(self, enabled: bool, *stages):
        self.stages = [s for s in stages if s is not None]
        self.parts, run = [], []
        for stage in [*self.stages, None]:
            if run and (stage is None or isinstance(stage, Outside)):
                self.parts.append(graphed(in_order(run), enabled))
                run = []
            if isinstance(stage, Outside):
                self.parts.append(stage)
            elif stage is not None:
                run.append(stage)

    def __call__(self, *inputs) -> list:
        return [out for part in self.parts for out in tree_leaves(part(*inputs)) if isinstance(out, torch.Tensor)]


def in_order(stages):
    """One function of the inputs that runs `stages` on them in order and returns their outputs."""

    def run(*inputs):
        return [stage(*inputs) for stage in stages]

    run.__name__ = "+".join(getattr(s, "__name__", "stage") for s in stages)
    return run
