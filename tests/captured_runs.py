"""`unit`'s --cudagraphs runs on 2 ranks (tests/dist_worker.py): a script's real `main()`, eager and with
--cudagraphs, every function a GPU would capture recorded by tests/graph_capture.py (`captured_runs`); and the
process group of its own that each run of `unit` opens (`own_group`)."""

import contextlib
import json
from pathlib import Path

from script_specs import SCRIPTS


def captured_runs(outdir: Path, script_path: str, store, rank: int) -> None:
    """The script's real main() on the 2 ranks of the `unit` launch: eager (DDP), then --cudagraphs under DDP and
    with --grad-sync flat, each graphed function recorded by tests/graph_capture.py; each run writes its report
    (`{stem}_captured_{run}_rank{R}.json`) and its checkpoint (`runs-{stem}-captured-{run}/r`)."""
    import graph_capture

    spec, stem = SCRIPTS[Path(script_path).name], Path(script_path).stem
    for run, grad_sync, graphed in (("eager", "ddp", False), ("ddp", "ddp", True), ("flat", "flat", True)):
        flags = [*spec.capture_flags, "--seed", 7, "--dist-timeout", 60, "--grad-sync", grad_sync, "--run-name", "r"]
        flags += ["--total-timesteps", 2 * spec.capture_timesteps, "--runs-dir", outdir / f"runs-{stem}-captured-{run}"]
        with own_group(store, f"{stem}-captured-{run}/"):
            if graphed:
                out = graph_capture.graphed_run(script_path, flags)
            else:
                out = dict(functions={}, error=graph_capture.run_main(script_path, [*flags, "--no-cudagraphs"]))
        (outdir / f"{stem}_captured_{run}_rank{rank}.json").write_text(json.dumps(out, indent=1))


@contextlib.contextmanager
def own_group(store, prefix: str):
    """The script run inside opens its process group (rt.start) in `store` under `prefix`, where no earlier group left
    keys; the group is closed after it, also when the run failed."""
    import torch.distributed as dist

    dist_init = dist.init_process_group

    def init_process_group(*args, **kw):
        return dist_init(*args, store=dist.PrefixStore(prefix, store), **kw)

    dist.init_process_group = init_process_group
    try:
        yield
    finally:
        dist.init_process_group = dist_init
        if dist.is_initialized():
            dist.destroy_process_group()
