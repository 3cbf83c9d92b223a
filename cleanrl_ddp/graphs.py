"""CUDA graphs (`--cudagraphs`, on by default): a function replayed as one CUDA graph instead of dozens of kernel
launches, each waiting on the host. A script wraps a function in one line where it is defined, as LeanRL does:

    capture = graphs.enabled(args, run)  # --cudagraphs on CUDA; on the CPU the same functions run eagerly
    policy_step = graphs.graphed(policy_step, capture)
    optimizer = graphs.optimizer(optim.Adam, agent.parameters(), args.learning_rate, device, fused=True)
    graphs.set_lr(optimizer, lr)  # annealing: written into the tensor that a captured step reads
    graphs.fill(next_obs, frames, staging)  # a graph's static input, from the page-locked staging copy

A collective never runs inside a graph. At world size 1 an update is one graph; across ranks the script graphs its
backward and its optimizer step apart and runs the gradient all-reduce between them, and under DDP, which
all-reduces inside backward, the backward stays eager.

A captured function replays the kernels of its capture on the tensors it used then, so every tensor it reads is an
argument (copied into the graph's static input at each call) or a buffer allocated once (rollout storage,
parameters, gradients, optimizer state); it makes no host sync and no collective; what must outlive a replay is
allocated before the capture (gradients before the loop, the optimizer's state by the eager warm-up calls).
Sampling stays reproducible: a replay advances CUDA's generator as the eager kernels would. docs/gpu.md says what
each script captures; the CPU tests prove it capturable (tests/graph_capture.py).
"""

from collections.abc import Callable

import torch

from cleanrl_ddp import checkpoint
from cleanrl_ddp.errors import RunError

WARMUP = 3  # calls before the capture: 2 eager (compile, the optimizer's state), then capture and replay


def torch_can_capture() -> bool:
    """Whether this torch captures what the scripts capture: sampling (`torch.multinomial` read its input on the
    host until pytorch#134818, September 2024; 2.6 is the first release sure to hold the fix)."""
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)


def enabled(args, run) -> bool:
    """Whether this run captures: --cudagraphs on a CUDA device. On CUDA with a torch older than 2.6, rank 0 says so
    in one line and the run goes on eagerly (the flag is on by default: an old torch is not bad input)."""
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
    """`fn` replayed as one CUDA graph (tensordict's `CudaGraphModule`) when `enabled`, else `fn` itself. Its first
    `WARMUP - 1` calls run eagerly, the next captures it; later calls copy their tensor arguments into the graph's
    static inputs, replay it and return copies of its outputs."""
    if not enabled:
        return fn
    from tensordict.nn import CudaGraphModule

    graph = CudaGraphModule(fn, warmup=WARMUP)
    graph.__name__ = getattr(fn, "__name__", "graph")
    return graph


def optimizer(cls, params, lr: float, device: torch.device, **kwargs) -> torch.optim.Optimizer:
    """`cls(params, lr=lr, **kwargs)` with its learning rate a float32 tensor on `device`, in every run, so that a
    captured step and an eager one compute the same bits; `set_lr` writes it in place. On CUDA it is capturable (its
    step stays on the device). A checkpoint holds the rate as a float and `capturable` False, as a plain optimizer's
    does; loading any checkpoint keeps this optimizer's tensor and its `capturable`, and refuses moments of another
    shape than their parameter's (`checkpoint.refuse_misfit_state`)."""
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
    return checkpoint.refuse_misfit_state(opt)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every param group's learning rate, written into the tensor that a captured step reads (`optimizer`)."""
    for group in opt.param_groups:
        group["lr"].fill_(lr)


def fill(static: torch.Tensor, array, staging: torch.Tensor) -> torch.Tensor:
    """`array` into `static`, a graph's static input on the device, through `staging` (page-locked on CUDA: the copy
    does not wait; the caller waits for the device, e.g. for the actions, before the next call overwrites it). On
    the CPU `static` may be `staging` itself (`staging.to(device)`): then nothing is copied."""
    staging.numpy()[...] = array
    return static.copy_(staging, non_blocking=True)
