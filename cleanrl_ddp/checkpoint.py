"""The checkpoint file, which no script reads directly: data only (tensors, numbers, strings, lists, dicts),
written atomically, read without running code, with the library versions and RNG streams it needs.

`run_dir` and `runtime.save_checkpoint` call these, and `evaluate` reads a run with them.
docs/runtime.md#checkpoints describes the format.
"""

import io
import os
import pickle
import random
import zipfile

import numpy as np
import torch

from cleanrl_ddp.errors import RunError

CHECKPOINT_TYPES = dict(
    script=str, args=dict, sizes=dict, world_size=int, iteration=int, global_step=int, rng=list, rank_state=list
)
"""the entries every checkpoint holds, and their types (`rng` and `rank_state`: one item per rank)"""
VERSIONED = ("torch", "gymnasium", "numpy", "mujoco", "ale-py")
"""the libraries whose versions a checkpoint records (a file that cannot be read is checked against them)"""


# ---------------------------------------------------------------------------------------------- reading
def load_checkpoint(path: str, script: str, required: tuple = ()) -> dict:
    """Load and validate a checkpoint of `script` holding `required` state; raise RunError with the reason."""
    if os.path.isdir(path):
        path = os.path.join(path, "checkpoint.pt")
    if not os.path.isfile(path):
        raise RunError(f"--resume: no checkpoint at {path}")
    try:
        ckpt = read_checkpoint(path)
    except RunError as e:
        raise RunError(f"--resume: {e}") from None
    if not isinstance(ckpt, dict) or ckpt.get("script") != script:
        found = ckpt.get("script") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise RunError(f"--resume: {path} was written by {found!r}, not {script}")
    missing = set(CHECKPOINT_TYPES).union(required) - ckpt.keys()
    if missing:
        raise RunError(f"--resume: {path} lacks {', '.join(sorted(missing))}; it was left as it is")
    wrong = [key for key, kind in CHECKPOINT_TYPES.items() if not isinstance(ckpt[key], kind)]
    if not wrong and (ckpt["world_size"] < 1 or {len(ckpt["rng"]), len(ckpt["rank_state"])} != {ckpt["world_size"]}):
        wrong = ["world_size, rng, rank_state (one item per rank)"]
    if not wrong and not all(type(v) in (int, float) for v in ckpt["sizes"].values()):
        wrong = ["sizes (numbers)"]
    if wrong:
        raise RunError(f"--resume: {path} has a malformed {', '.join(wrong)}; it was left as it is")
    return ckpt


def refuse_misfit_state(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`opt`, whose `load_state_dict` raises ValueError for state (Adam's `exp_avg`, ...) of another shape than its
    parameter's: torch would load it, and the first step trip over it, far from the file (`runtime.exit_codes`)."""

    def check(opt):
        for group in opt.param_groups:
            for p in group["params"]:
                shapes = {k: tuple(v.shape) for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v) and v.dim()}
                if any(shape != tuple(p.shape) for shape in shapes.values()):
                    raise ValueError(f"optimizer state {shapes} for a parameter of shape {tuple(p.shape)}")

    opt.register_load_state_dict_post_hook(check)
    return opt


def read_checkpoint(path: str) -> dict:
    """`torch.load` a checkpoint as data only (tensors, numbers, strings, lists, dicts): loading never runs code.

    Raises RunError naming the likely cause: a damaged file (its zip archive is torn), the old pickled format
    (refused: it cannot be read safely), or an intact file this torch cannot read (another version wrote it).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several error types for truncated, foreign or pickled files
        error = e
    try:
        with zipfile.ZipFile(path) as archive:
            intact = archive.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError):
        intact = False
    if not intact:
        raise RunError(f"{path} is truncated or corrupt (a damaged file: {type(error).__name__}); it was left as it is")
    if isinstance(error, pickle.UnpicklingError) and "Unsupported global" in str(error):
        raise RunError(
            f"{path} holds pickled objects (the format before checkpoints became data): loading it would run code "
            "the file carries, so it cannot be read safely; it was left as it is"
        )
    raise RunError(
        f"{path} is intact but torch {torch.__version__} cannot read it ({type(error).__name__}): most likely "
        "a version mismatch (written by another torch); it was left as it is"
    )


def check_saved_env_id(saved: str, given: str, source: str) -> None:
    """A checkpoint's env id is data too: `module:Env` would import `module` when the env is made, so it is
    accepted only when this command line names the same id."""
    if ":" in saved and saved != given:
        raise RunError(
            f"{source} names the env {saved!r}, whose module prefix would import and run {saved.split(':')[0]!r}: "
            f"pass --env-id {saved} on this command line if you trust it"
        )


# ---------------------------------------------------------------------------------------------- writing
def library_versions() -> dict:
    """The installed versions of the libraries a checkpoint depends on (None: not installed)."""
    from importlib import metadata

    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def atomic_save(obj, path: str) -> None:
    """Write `obj` so that a crash at any instant leaves either the old or the new file, never a torn one.

    Serialised in memory first, so that a full disk raises a plain OSError (ENOSPC, EFBIG) from
    `write`, not an error from inside torch's zip writer.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sync_events(writer) -> None:
    """Flush TensorBoard's event file and fsync it, so that it is as durable as the checkpoint written next."""
    writer.flush()
    event_writer = getattr(writer._get_file_writer(), "event_writer", None)
    path = getattr(event_writer, "_file_name", None)
    if path and os.path.exists(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------------- RNG streams as data
def rng_states(device: torch.device) -> dict:
    """Python's, NumPy's, torch's (and CUDA's) global RNG states, as data (ints, lists and tensors)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    numpy = dict(kind=kind, key=torch.from_numpy(key.astype(np.int64)), pos=pos, has_gauss=has_gauss, gauss=gauss)
    states = dict(python=random.getstate(), numpy=numpy, torch=torch.get_rng_state())
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = states["numpy"]
    np.random.set_state(
        (numpy["kind"], numpy["key"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"], numpy["gauss"])
    )
    torch.set_rng_state(states["torch"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
