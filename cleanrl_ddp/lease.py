"""The run directory's lease: one live run writes a run directory, and a second launch of the same run stops.

The main rank takes the lease where `run_dir` claims the run directory (`choose_run_dir`; `claim_run_dir` for a new one)
and holds it until the process ends: a POSIX record lock (`fcntl.lockf`) on `{run dir}/lease`, whose text
names the holder (host, pid, launch id). The operating system drops the lock when the process dies, however
it dies (an exit, an error, SIGKILL, an out-of-memory kill), so a restart (torchrun's, a SLURM requeue,
`--resume`) takes the directory over as soon as the holder is gone. A record lock, not `flock`: processes the
holder forks (env workers) do not inherit it, so they cannot keep a dead run's directory locked.

On a network file system the lock holds across hosts only where the file system implements POSIX locks
between clients (NFSv4, NFSv3 with lockd; Lustre mounted with `-o flock`). Where it does not (NFS mounted
`nolock`, Lustre `localflock`), two launches on different hosts do not see each other's lease; where locks
fail outright (Lustre without a flock option: ENOSYS), the run says so in one line and goes on without one.
"""

import errno
import fcntl
import os
import socket
import sys
from typing import Optional

LEASE_FILE = "lease"
_held: dict = {}  # run directory -> the open lease file descriptor; open (and locked) until this process ends


def holder_text(launch: str) -> str:
    return f"host {socket.gethostname()}, pid {os.getpid()}, launch {launch}"


def take_or_refuse(run_dir: str, launch: str) -> Optional[str]:
    """Take `run_dir`'s lease and hold it until this process ends: None. When a live process holds it, take nothing
    and return the one-line refusal to stop with (nothing was written: the lease file exists while it is held)."""
    if run_dir in _held:
        return None
    path = os.path.join(run_dir, LEASE_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a directory this process cannot write: `claim_run_dir` says so in one line
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process still writing its name"
            os.close(fd)
            return (
                f"{run_dir} is in use by a live run ({holder}): a second launch of the same run; stop that one first, "
                "or pass another --run-name (nothing was written)"
            )
        os.close(fd)  # the file system has no locks: go on without one
        print(f"warning: no lease on {run_dir} ({e.strerror}): a second launch would not be stopped", file=sys.stderr)
        return None
    text = holder_text(launch).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, text, 0)
    _held[run_dir] = fd
    return None
