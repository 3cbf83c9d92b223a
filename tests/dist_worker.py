"""What `torchrun` launches for tests/test_distributed_correctness.py: one mode, run by every rank.

    torchrun ... tests/dist_worker.py unit  OUTDIR cleanrl_ddp/<script>.py [cleanrl_ddp/<script>.py ...]
    torchrun ... tests/dist_worker.py batch JOBS.json

`unit` compares each listed script's distributed updates with the single-process ones (tests/unit_updates.py); one
launch covers several scripts. Then, in the same processes, it runs the real `main()` of each script with a
--compile flag (`ScriptSpec.compiled`, tests/script_specs.py) with --compile under DDP and with --grad-sync flat,
records what torch.compile traced (tests/compiled_runs.py) and runs the same commands eagerly; and of each script
whose 2-rank --cudagraphs runs are checked (`ScriptSpec.captured`), eagerly and with --cudagraphs under DDP and
flat, every function that a GPU captures recorded by tests/graph_capture.py (tests/captured_runs.py).
`batch` runs whole scripts unchanged, one after another in the same ranks, each in one of four modes: observe,
diverge, pinned or plain (tests/observed_runs.py).
Each rank writes OUTDIR/rank{R}.pt and OUTDIR/exit{R} (batch) or OUTDIR/<script>_unit_rank{R}.json (unit).
torchrun runs this file as a script, so tests/ is on sys.path and the modules above import as top-level modules,
as they do in the tests (pytest puts tests/ on sys.path too).
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from captured_runs import captured_runs, own_group
from compiled_runs import compiled_run
from observed_runs import observe, pin_sampling_and_minibatches, run_script
from script_specs import SCRIPTS
from unit_updates import unit_sac, unit_script, unit_td3


def unit(outdir: Path, script_paths: list) -> None:
    import graph_capture
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for script_path in script_paths:
        spec = SCRIPTS[Path(script_path).name]
        out = (unit_sac if spec.sac else unit_td3 if spec.td3 else unit_script)(script_path, rank, world_size)
        (outdir / f"{Path(script_path).stem}_unit_rank{rank}.json").write_text(json.dumps(out, indent=1))
    store = dist.distributed_c10d._get_default_store()  # torchrun's store, for the process groups of the scripts
    dist.destroy_process_group()
    for script_path in script_paths:  # the scripts with --compile: their real main(), DDP and flat, then eager
        spec, stem = SCRIPTS[Path(script_path).name], Path(script_path).stem
        for grad_sync in ("ddp", "flat") if spec.compiled else ():
            flags = [*spec.tiny, "--seed", 7, "--dist-timeout", 60, "--grad-sync", grad_sync, "--run-name", "r"]
            flags += ["--total-timesteps", spec.compile_timesteps]
            with own_group(store, f"{stem}-{grad_sync}/"):
                out = compiled_run(script_path, [*flags, "--runs-dir", outdir / f"runs-{stem}-{grad_sync}"])
            with own_group(store, f"{stem}-{grad_sync}-eager/"):  # the same command without --compile
                runs = outdir / f"runs-{stem}-{grad_sync}-eager"
                out["eager_error"] = graph_capture.run_main(script_path, [*flags, "--runs-dir", runs])
            (outdir / f"{stem}_compiled_{grad_sync}_rank{rank}.json").write_text(json.dumps(out, indent=1))
        if "flat" in spec.captured:  # --cudagraphs: what it would capture, recorded; its runs against eager
            captured_runs(outdir, script_path, store, rank)


REAL_EXIT = os._exit


def leave(code) -> None:
    """Exit as the scripts do, without interpreter finalization (where gloo's threads can abort)."""
    sys.stdout.flush()
    sys.stderr.flush()
    REAL_EXIT(code if isinstance(code, int) else (0 if code is None else 1))


def batch(jobs_file: Path) -> None:
    """The runs listed in `jobs_file`, one after another in these processes, each as a launch of its own would run
    it: JSON of dict(mode, script, args, outdir, global_envs), `mode` one of observe, diverge, pinned (`global_envs`
    its G) or plain (the script alone, nothing recorded). Starting a rank (importing torch and what its optimizers
    import) costs more than a tiny run: here it is paid once for all. Each run meets its peers in a process group of
    its own (torchrun's store, under the run's index); every patch a run made is removed before the next, and each
    run writes its exit code to OUTDIR/exit{R}, what it printed to OUTDIR/output{R} and what it recorded to
    OUTDIR/rank{R}.pt."""
    import torch.distributed as dist

    rank, store, dist_init = int(os.environ.get("RANK", 0)), None, dist.init_process_group
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # torchrun's store, reached without a process group of its own
        store, _, _ = next(dist.rendezvous("env://"))
    for i, job in enumerate(json.loads(jobs_file.read_text())):
        outdir, script, args = Path(job["outdir"]), job["script"], job["args"]
        outdir.mkdir(parents=True, exist_ok=True)
        output = open(outdir / f"output{rank}", "w")  # noqa: SIM115 (closed below, with the run's other patches)

        def init_process_group(*a, prefix=f"run{i}/", **kw):  # called by the script's rt.start
            return dist_init(*a, store=dist.PrefixStore(prefix, store), **kw)

        dist.init_process_group = init_process_group
        unpin = pin_sampling_and_minibatches(script, args, job["global_envs"]) if job["mode"] == "pinned" else None
        try:
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                if job["mode"] == "plain":
                    code = run_script(script, args)
                else:
                    code = observe(outdir, script, args, nudge_after_step=2 if job["mode"] == "diverge" else 0)
        finally:
            output.close()
            dist.init_process_group = dist_init
            if unpin is not None:
                unpin()
            if dist.is_initialized():
                dist.destroy_process_group()
        # whole or not at all: a test waiting for the run to stop reads it while the batch goes on
        (outdir / f"exit{rank}.tmp").write_text(str(code))
        os.replace(outdir / f"exit{rank}.tmp", outdir / f"exit{rank}")


if __name__ == "__main__":
    mode, path, *scripts = sys.argv[1:]
    try:
        if mode == "unit":
            Path(path).mkdir(parents=True, exist_ok=True)
            unit(Path(path), scripts)
        else:
            batch(Path(path))
    except SystemExit as e:
        leave(e.code)
    leave(0)
