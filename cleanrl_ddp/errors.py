"""The exit codes of a run and `RunError`, the error a user can fix. A leaf: it imports nothing of ours, so every
module (runtime, launch, checkpoint, lease, atari, the scripts) can raise it without an import cycle."""

import errno
import threading

EXIT_BAD_INPUT = 2
"""exit code: invalid flags, environment, checkpoint or run directory, a full disk or sizes beyond memory (nothing
was overwritten)"""
EXIT_DIVERGED = 3
"""exit code: `--sync-check-every` found replicas whose parameters or optimizer state differ"""
EXIT_LOST_RANK = 4
"""exit code: a collective failed: another rank died, stalled past `--dist-timeout`, or the network broke"""
EXIT_PREEMPTED = 75
"""exit code: stopped by SIGTERM/SIGUSR1 after saving a checkpoint; relaunch to resume (EX_TEMPFAIL)"""
EXIT_INTERRUPTED = 130
"""exit code: a second Ctrl-C stopped the run at once, without a checkpoint (128 + SIGINT)"""
EXIT_OUTPUT_CLOSED = 141
"""exit code: whatever read the output closed it (`--help | head`), silently, as a shell tool stops (128 + SIGPIPE)"""


LOAD_ERRORS = (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError)
"""what loading a file's state into objects raises when the state does not fit them (another shape, another type)"""


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is a failed allocation: numpy's MemoryError, torch's on the host or on a GPU."""
    return isinstance(e, MemoryError) or any(s in str(e) for s in ("can't allocate memory", "out of memory"))


def disk_full(e: BaseException) -> bool:
    """Whether `e` is a write that found no room: a full disk, a file-size limit, a quota."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def quiet_writer_disk_full(hook: threading.ExceptHookArgs) -> None:
    """`threading.excepthook` while a run's logs are open: a full disk in TensorBoard's writer thread stays quiet, as
    TensorBoard raises it again at the loop's next write, where `exit_codes` says it once. Any other thread's error,
    a full disk included, is printed by Python's own hook."""
    if not (disk_full(hook.exc_value) and type(hook.thread).__module__.startswith("tensorboard.")):
        threading.__excepthook__(hook)


def one_line(e: BaseException) -> str:
    """`Type: message` on one line of at most 240 characters (torch's load errors span several)."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:240]


class RunError(ValueError):
    """An error the user can fix; printed as one line by rank 0, then exit with `code`."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.code = code
