"""CUDA graphs (`--cudagraphs`): a function as one graph replay, and an update as few replays as data parallelism
allows. Docs: docs/sac_continuous_action_multigpu.md (detail 10).

A CUDA graph records a function's kernels once and replays them with one launch from the host, which removes the
launch overhead that dominates SAC's and TD3's small updates (LeanRL's `CudaGraphModule` around `update_main`,
`update_pol` and the policy). A captured function must not wait for the device on the host, allocate what outlives
a call (gradients and optimizer state exist before the capture), branch on data, or run a collective: so at world
size > 1 an update is cut at its gradient all-reduces, which run between two replays, never inside one.

On the CPU (and without --cudagraphs) the same functions run eagerly, in the same order: the CPU tests run every
line but the capture.
"""

import torch
from torch.utils._pytree import tree_leaves

from cleanrl_ddp.errors import RunError

WARMUP = 3  # calls before the capture: the first run eagerly (optimizer state, --compile's compilation)


def enabled(args, run) -> bool:
    """Whether --cudagraphs captures: on CUDA only (on the CPU the same functions run eagerly). RunError where it
    cannot: DDP all-reduces inside backward, which the graph would capture."""
    if args.cudagraphs and run.world_size > 1 and args.grad_sync == "ddp":
        raise RunError("--cudagraphs at world size > 1 needs --grad-sync flat (DDP all-reduces inside backward)")
    if args.cudagraphs and run.on_cuda:
        try:
            from tensordict.nn import CudaGraphModule  # noqa: F401
        except ImportError as e:
            raise RunError(f"--cudagraphs needs tensordict's CudaGraphModule (pip install 'tensordict>=0.14'): {e}")
    return args.cudagraphs and run.on_cuda


def graphed(fn, enabled: bool):
    """`fn`, recorded as a CUDA graph at its `WARMUP`-th call and replayed after (tensordict's `CudaGraphModule`:
    tensor inputs copied into the graph's own, outputs cloned), or `fn` itself when not `enabled`."""
    if not enabled:
        return fn
    from tensordict.nn import CudaGraphModule

    graph = CudaGraphModule(fn, warmup=WARMUP)
    graph.__name__ = getattr(fn, "__name__", "graph")  # the stages it holds (benchmark/profile_offpolicy.py)
    return graph


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
