"""CUDA graphs (`--cudagraphs`, on by default where a script's path was proven on a GPU): a function replayed as one
CUDA graph instead of dozens of kernel launches, each waiting on the host. docs/correctness.md (`--cudagraphs`) says
what is captured and how the CPU tests prove it safe to capture.

A script wraps a function in one line where it is defined, as LeanRL does:

    capture = graphs.enabled(args, run)  # --cudagraphs on CUDA: on the CPU the same functions run eagerly
    policy_step = graphs.graphed(policy_step, capture)  # the rollout's step, one replay
    optimizer = graphs.optimizer(optim.Adam, agent.parameters(), args.learning_rate, args.cudagraphs, device, ...)
    graphs.set_lr(optimizer, lr)  # annealing: written into the tensor that a captured step reads
    graphs.fill(next_obs, frames, staging)  # the graph's static input, from the page-locked staging copy
    update = graphs.Update(capture, *graphs.optimizer_step(minibatch_backward, clip_and_step, all_reduce, ddp))

An update is a list of stages, and one rule cuts it, the same in every script: a collective never runs inside a
graph. The flat all-reduce of the gradients runs between two graphs (`Outside`); DDP all-reduces inside backward, so
under DDP the backward runs eagerly and what follows it is captured (`optimizer_step`). Each run of stages between
two such cuts is one graph (`Update`): at world size 1 a whole update is one replay.

Only a CUDA device captures: on the CPU the same functions run eagerly, in the same order, so the CPU tests run every
line but the capture itself (a value, not an error: the flag asks for speed where there is speed to gain). A captured
function replays the kernels it launched at capture on the tensors it used then, so:
- every tensor it reads is an argument (copied into the graph's static input at each call) or a buffer allocated
  once (rollout storage, parameters, gradients, optimizer state), never a tensor made anew between calls;
- it makes no host sync (no `.item()`, no data-dependent shape) and no collective;
- what must outlive a replay is allocated before the capture: gradients once before the loop, the optimizer's
  state by the eager warm-up calls (or the checkpoint); outputs are copies (tensordict's `CudaGraphModule`).
Random numbers stay reproducible: the CUDA generator advances by the same offsets whether a kernel is launched
eagerly or replayed (PyTorch registers the generator with the graph; each replay moves its offset on the host),
and the warm-up calls are real calls, so a resumed run continues the stream its checkpoint saved.
"""

import time
from collections.abc import Callable
from typing import Optional

import torch

from cleanrl_ddp.errors import RunError

WARMUP = 3  # calls before the capture: 2 eager (compile, the optimizer's state), then capture and replay


def torch_can_capture() -> bool:
    """Whether this torch captures what the scripts capture: sampling (`torch.multinomial` read its input on the
    host until pytorch#134818, September 2024; 2.6 is the first release sure to hold the fix)."""
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)


def enabled(args, run) -> bool:
    """Whether this run captures: --cudagraphs on a CUDA device. On the CPU the same functions run eagerly. On CUDA
    with a torch older than 2.6, rank 0 says so in one line and the run goes on eagerly (the flag is on by default:
    an old torch is not bad input)."""
    if not (args.cudagraphs and run.on_cuda):
        return False
    if not torch_can_capture():
        if run.is_main:
            print(f"--cudagraphs: torch {torch.__version__} cannot capture sampling (2.6 can): running eagerly")
        return False
    try:
        from tensordict.nn import CudaGraphModule  # noqa: F401
    except ImportError as e:
        raise RunError(f"--cudagraphs needs tensordict's CudaGraphModule (pip install 'tensordict>=0.14'): {e}")
    return True


def graphed(fn: Callable, enabled: bool) -> Callable:
    """`fn` replayed as one CUDA graph (tensordict's `CudaGraphModule`, on the current CUDA device) when `enabled`
    (`graphs.enabled`), else `fn` itself. Its first `WARMUP - 1` calls run eagerly; the next runs it and captures it;
    later calls copy their tensor arguments into the graph's static inputs and replay it, and return copies of its
    outputs. The CPU tests replace it with a recorder of every function passed here (tests/graph_capture.py): pass
    only what --cudagraphs captures."""
    if not enabled:
        return fn
    from tensordict.nn import CudaGraphModule

    graph = CudaGraphModule(fn, warmup=WARMUP)
    graph.__name__ = getattr(fn, "__name__", "graph")
    return graph


def optimizer(cls, params, lr: float, enabled: bool, device: torch.device, **kwargs) -> torch.optim.Optimizer:
    """`cls(params, lr=lr, **kwargs)`. With --cudagraphs (`enabled`), on every device (one code path), its learning
    rate is a float32 tensor on `device` (what CUDA's fused Adam reads), written in place by `set_lr`, so that a
    captured step reads each iteration's rate; on CUDA it is capturable (a step on the device, no host sync).

    The rate in float32 rounds it: the run differs from a --no-cudagraphs one by that (relative <= 6e-8 of the rate)
    unless the rate is a float32 number (2**-12 and its annealed values at a power-of-two number of iterations are:
    what the tests compare bitwise). Checkpoints are the eager ones': the saved rate is a float and not capturable,
    and loading one keeps this run's tensor (the saved param group would replace it)."""
    if not (enabled and torch_can_capture()):
        return cls(params, lr=lr, **kwargs)
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
    checkpoint is loaded into it: torch takes a loaded param group's hyperparameters, and a checkpoint of an optimizer
    made without `capturable` says False, with which a captured step raises. The math is the same either way."""

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


class Outside:
    """A stage of an `Update` that runs eagerly, between its CUDA graphs: `fn(*inputs)`, one that runs a collective.
    `seconds`: the wall time of its calls so far."""

    def __init__(self, fn: Callable):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *inputs):
        start = time.perf_counter()
        out = self.fn(*inputs)
        self.seconds += time.perf_counter() - start
        return out


def optimizer_step(backward: Callable, step: Callable, all_reduce: Optional[Callable], ddp: bool) -> list:
    """One optimizer step as the stages of an `Update`, cut where its gradients are averaged across ranks.
    `backward(*inputs)` makes this rank's gradients (and returns the stats), `step(*inputs)` applies the averaged
    ones. With the flat all-reduce (`all_reduce()`, None where there is none: world size 1, or DDP) it runs eagerly
    between the two, each of them captured; under DDP (`ddp`), which all-reduces inside backward, `backward` runs
    eagerly and `step` is captured with whatever follows it."""
    if ddp:
        return [Outside(backward), step]
    return [backward, Outside(lambda *_: all_reduce()) if all_reduce else None, step]


class Update:
    """One update as one call of its inputs: `stages` in order, each a function of the inputs or an `Outside`
    (None: nothing, e.g. no all-reduce at world size 1). A call returns what the stages returned, in order, leaving
    out None. With `enabled` (`graphs.enabled`), each run of stages between two `Outside` ones is one CUDA graph
    (`parts`): at world size 1 a whole update is one replay."""

    def __init__(self, enabled: bool, *stages):
        self.parts, run = [], []
        for stage in [*(s for s in stages if s is not None), None]:
            if run and (stage is None or isinstance(stage, Outside)):
                self.parts.append(graphed(in_order(run), enabled))
                run = []
            if isinstance(stage, Outside):
                self.parts.append(stage)
            elif stage is not None:
                run.append(stage)

    def __call__(self, *inputs) -> list:
        out = []
        for part in self.parts:
            returned = part(*inputs)
            out += [returned] if isinstance(part, Outside) else returned
        return [x for x in out if x is not None]

    def take_outside_seconds(self) -> float:
        """The wall time of its `Outside` stages since the last take (with the flat all-reduce: the all-reduces')."""
        outside = [part for part in self.parts if isinstance(part, Outside)]
        seconds = sum(part.seconds for part in outside)
        for part in outside:
            part.seconds = 0.0
        return seconds


def in_order(stages):
    """One function of the inputs that runs `stages` on them in order and returns their outputs."""

    def run(*inputs):
        return [stage(*inputs) for stage in stages]

    run.__name__ = "+".join(getattr(s, "__name__", "stage") for s in stages)
    return run
