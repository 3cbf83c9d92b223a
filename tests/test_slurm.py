"""SLURM, for real: a single-host cluster (Debian's slurm-wlm and munge) started once for the test session in a
temporary directory, and real jobs submitted with srun and sbatch: two tasks on one node, and
benchmark/slurm/requeue.sbatch itself through its signal paths (the warning before the time limit,
`scancel --signal=USR1 --full`, a plain `scancel`, a partition preemption). docs/runtime.md, "SLURM", says
what each path does; these tests check it.

What one host cannot play keeps no test here: a job on two nodes (a requeue onto another node count, the
tasks-per-node entry of a second node; tests/test_runtime.py reads the compressed layouts SLURM gives then).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import pytest
from helpers import REPO, free_port, only_run_dir, wait_until
from test_fault_tolerance import PPO, assert_steps_complete, first_checkpoint, load

INSTALL = "apt-get install -y slurm-wlm munge"
DAEMONS = ("munged", "slurmctld", "slurmd")
REQUEUE_SBATCH = REPO / "benchmark" / "slurm" / "requeue.sbatch"
# requeue.sbatch's resource lines, overridden for one host with 2 cores (sbatch options win over #SBATCH lines)
ONE_HOST = ("--nodes=1", "--ntasks-per-node=2", "--gpus-per-task=0", "--cpus-per-task=1")


class Cluster:
    """A running single-host SLURM: its directory and the environment that its commands need (SLURM_CONF)."""

    def __init__(self, root: Path, env: dict):
        self.root, self.env = root, env

    def run(self, *cmd, check=True) -> str:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc.stdout

    def sbatch(self, *args, cwd=REPO) -> int:
        return int(self.run("sbatch", "--parsable", f"--chdir={cwd}", *map(str, args)).split(";")[0])

    def job(self, job_id: int) -> dict:
        """`scontrol show job` as a dict (JobState, Reason, Restarts, ExitCode, ...)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "show", "job", "-o", str(job_id))))

    def wait_for(self, job_id: int, condition, timeout: float, log: Path | None = None, what="") -> dict:
        """Poll the job until `condition(job dict)`; fail after `timeout` s with the job and its log."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if condition(job):
                return job
            if time.monotonic() > deadline:
                text = log.read_text() if log is not None and log.exists() else ""
                raise AssertionError(f"job {job_id}: no {what} within {timeout} s: {job}\n{text}")
            time.sleep(0.2)

    def finish(self, job_id: int, timeout: float, log: Path) -> dict:
        """Wait until the job has ended for good. A requeued job waits PENDING (Reason=BeginTime) until the old
        attempt's credential has expired (cred_expire, 10 s here, 120 s by default), then for the scheduler's
        next pass: once its begin time has passed, `StartTime=now` starts it (sooner, it would fail)."""

        def ended(job):
            begin = job["StartTime"]  # a pending job's begin time, or "Unknown"
            if job["JobState"] == "PENDING" and begin[:1].isdigit() and datetime.fromisoformat(begin) < datetime.now():
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
            return job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")

        return self.wait_for(job_id, ended, timeout, log, "end")


def stop(procs: dict) -> None:
    """SIGTERM each daemon (slurmd first), SIGKILL what is still there 20 s later."""
    for name in reversed(DAEMONS):
        if name in procs and procs[name].poll() is None:
            procs[name].terminate()
    for name in reversed(DAEMONS):
        if name in procs:
            try:
                procs[name].wait(20)
            except subprocess.TimeoutExpired:
                procs[name].kill()
                procs[name].wait()


@pytest.fixture(scope="session")
def slurm():
    """A single-host SLURM in a temporary directory: config, state, logs, munge key and socket there; munged,
    slurmctld and slurmd in the foreground as children of this fixture, stopped by it after the session."""
    missing = [p for p in (*DAEMONS, "srun", "sbatch", "scontrol", "scancel") if shutil.which(p) is None]
    if missing:
        pytest.skip(f"needs SLURM and munge ({', '.join(missing)} not found): {INSTALL}")
    if os.geteuid() != 0:
        pytest.skip("needs root: slurmd starts each job's processes as the job's user")
    root = Path(tempfile.mkdtemp(prefix="cleanrl_ddp_slurm_"))
    root.chmod(0o755)  # munged refuses a socket in a directory that not everyone may enter
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    node = socket.gethostname().split(".")[0]
    hardware = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=60).stdout
    cpus, memory = (re.search(rf"{name}=(\d+)", hardware).group(1) for name in ("CPUs", "RealMemory"))
    (root / "slurm.conf").write_text(
        f"""ClusterName=cleanrl_ddp_test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobRequeue=1
MinJobAge=600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=low Nodes={node} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=high Nodes={node} MaxTime=INFINITE State=UP PriorityTier=2
"""
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env |= {"SLURM_CONF": str(root / "slurm.conf"), "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the jobs' `python` is this one
    commands = {
        "munged": ["munged", "-F", f"--key-file={key}", f"--socket={root}/munge.socket"]
        + [f"--pid-file={root}/munged.pid", f"--seed-file={root}/munged.seed", f"--log-file={root}/log/munged.log"],
        "slurmctld": ["slurmctld", "-D", "-c"],  # -c: a clean start, no state from an earlier cluster
        "slurmd": ["slurmd", "-D", "-N", node],
    }
    procs, cluster = {}, Cluster(root, env)
    try:
        for name, cmd in commands.items():
            out = open(root / "log" / f"{name}.out", "w")
            procs[name] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if name == "munged":
                wait_until(lambda: (root / "munge.socket").exists(), 30, procs[name], "munge socket")
        deadline = time.monotonic() + 60
        while cluster.run("sinfo", "-h", "-o", "%t", check=False).strip() != "idle":
            dead = [name for name, proc in procs.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"{p.name}: {p.read_text()[-2000:]}" for p in sorted((root / "log").iterdir()))
                raise RuntimeError(f"the test SLURM did not start ({dead or 'no idle node in 60 s'}):\n{logs}")
            time.sleep(0.2)
        yield cluster
    finally:
        # End every job first: a job's slurmstepd outlives slurmd
        if "slurmctld" in procs and procs["slurmctld"].poll() is None:
            cluster.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
            cluster.run("scancel", "--user=root", check=False)
            deadline = time.monotonic() + 60
            while cluster.run("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        stop(procs)
        shutil.rmtree(root, ignore_errors=True)


def srun(cluster, *options, env=None, timeout=120) -> subprocess.CompletedProcess:
    """`srun OPTIONS python ppo_multigpu.py` (2 iterations), as a user types it."""
    flags = PPO.args(2, tempfile.mkdtemp(dir=cluster.root), nproc=2)
    cmd = ["srun", *options, "python", f"cleanrl_ddp/{PPO.name}", *map(str, flags)]
    env = {**cluster.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "options, env, threads",
    [
        (["--ntasks=2", "--cpu-bind=none"], {}, r"1 thread\(s\) per rank \(2 core\(s\) / 2 rank\(s\)\)"),
        (["--ntasks=2", "--ntasks-per-node=2"], {}, r"1 thread\(s\) per rank \(srun bound it to 1 core\(s\)\)"),
        (["--ntasks=2"], {"OMP_NUM_THREADS": "2"}, r"2 thread\(s\) per rank \(OMP_NUM_THREADS\)"),
    ],
    ids=["plain", "ntasks-per-node-bound", "omp-num-threads"],
)
def test_srun_two_tasks_know_their_node_and_threads(slurm, options, env, threads):
    """Plain `srun --ntasks=2` sets no SLURM_NTASKS_PER_NODE: the ranks still count 2 on the node and share its
    cores; a task that srun bound (task/affinity, its default here) takes its own cores; OMP_NUM_THREADS wins."""
    if int(slurm.run("sinfo", "-h", "-o", "%c").strip()) != 2:
        pytest.skip("the expected thread counts are for a 2-core node")
    result = srun(slurm, *options, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(
        rf"^ppo_multigpu: 2 rank\(s\) \(2 on this node\), device cpu, {threads}, backend gloo$", result.stdout, re.M
    ), result.stdout


def submit_requeue(cluster, tmp_path, iterations: int, *options) -> tuple[int, Path, Path]:
    """benchmark/slurm/requeue.sbatch, its resource lines overridden for this host, on a tiny ppo_multigpu run
    that checkpoints every iteration; returns the job id, its log and its runs directory."""
    log, runs = tmp_path / "slurm.log", tmp_path / "runs"
    flags = PPO.args(iterations, runs, "--checkpoint-every", 1, nproc=2)
    job_id = cluster.sbatch(*ONE_HOST, f"--output={log}", *options, REQUEUE_SBATCH, *flags)
    return job_id, log, runs


def task_pids(job_id: int) -> list[int]:
    """The process ids of the job's tasks (its `python` processes; srun's command line names the script too)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone
            continue
        if Path(argv[0].decode()).name.startswith("python") and f"SLURM_JOB_ID={job_id}".encode() in environ:
            pids.append(int(proc.name))
    return sorted(pids)


def hold(job_id: int, sig: signal.Signals, timeout: float) -> None:
    """Stop the job's tasks (SIGSTOP) until SLURM has sent them `sig`, then let them go on: the signal comes
    mid-run however fast this machine trains. A task that SLURM continued (it sends SIGCONT with some signals), or
    that has already ended, needs no more waiting."""
    tasks = task_pids(job_id)
    for pid in tasks:
        os.kill(pid, signal.SIGSTOP)

    def received(pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return True
        pending = int(re.search(r"^ShdPnd:\s*(\w+)", status, re.M).group(1), 16)
        stopped = re.search(r"^State:\s*T", status, re.M) is not None
        return bool(pending & (1 << (sig - 1))) or not stopped

    try:
        wait_until(lambda: all(received(pid) for pid in tasks), timeout, what=f"{sig.name} from SLURM")
    finally:
        for pid in tasks:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_requeue_sbatch_saves_before_its_time_limit_and_resumes_after_the_requeue(slurm, tmp_path):
    """--time=2 and the file's --signal=USR1@90: SIGUSR1 reaches the tasks before the time limit (SLURM checks
    every 30 s, so it comes 30 to 60 s into the job); they save and exit 75, the script requeues the job, and the
    requeued job resumes in the same run directory and finishes: exit 0, every logged step once."""
    iterations = 30
    job_id, log, runs = submit_requeue(slurm, tmp_path, iterations, "--time=2")
    wait_until(lambda: first_checkpoint(runs), 120, what="first checkpoint")
    hold(job_id, signal.SIGUSR1, 120)
    job = slurm.finish(job_id, 240, log)
    text = log.read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert int(job["Restarts"]) >= 1, text  # a slow machine may need a second warning and requeue
    assert f"preempted (exit 75): checkpoint saved, requeueing job {job_id}" in text, text
    assert "resuming at iteration" in text, text
    run_dir = only_run_dir(runs)
    assert run_dir.name.endswith(f"__slurm{job_id}")
    assert load(run_dir / "checkpoint.pt")["global_step"] == iterations * 2 * PPO.local_steps
    assert_steps_complete(run_dir, iterations, PPO)


def test_scancel_signal_usr1_full_saves_and_requeues(slurm, tmp_path):
    """`scancel --signal=USR1 --full` signals the batch shell too: its trap passes the signal on, the tasks save and
    exit 75, and the job is requeued (before, the shell died of SIGUSR1 and the job ended FAILED)."""
    job_id, log, runs = submit_requeue(slurm, tmp_path, 10_000)
    wait_until(lambda: first_checkpoint(runs), 120, what="first checkpoint")
    slurm.run("scancel", "--signal=USR1", "--full", str(job_id))
    job = slurm.wait_for(job_id, lambda j: j["JobState"] == "PENDING", 120, log, "requeue")
    slurm.run("scancel", str(job_id))  # a pending job: cancelled at once
    text = log.read_text()
    assert job["Reason"] == "BeginTime" and job["Restarts"] == "1", job
    assert "batch script: SIGUSR1, passed on to the tasks" in text, text
    assert f"preempted (exit 75): checkpoint saved, requeueing job {job_id}" in text, text
    assert "preempted by a signal at global step" in text, text


def test_plain_scancel_saves_and_stops_without_a_requeue(slurm, tmp_path):
    """A plain `scancel JOB` sends SIGTERM to the tasks and the batch shell: the tasks save and exit 75 within
    KillWait, and the script does not requeue a cancelled job (before, it did: scancel could not stop a run)."""
    job_id, log, runs = submit_requeue(slurm, tmp_path, 10_000)
    wait_until(lambda: first_checkpoint(runs), 120, what="first checkpoint")
    slurm.run("scancel", str(job_id))
    job = slurm.wait_for(job_id, lambda j: j["JobState"] not in ("RUNNING", "COMPLETING"), 120, log, "end")
    wait_until(lambda: "not requeued" in log.read_text(), 30, what="the script's last line")
    text = log.read_text()
    assert (job["JobState"], job["Restarts"]) == ("CANCELLED", "0"), job
    assert f"cancelled (exit 75): checkpoint saved, job {job_id} not requeued" in text, text
    step = int(re.search(r"preempted by a signal at global step (\d+)", text).group(1))
    assert load(only_run_dir(runs) / "checkpoint.pt")["global_step"] == step


def test_preempted_by_a_higher_priority_partition_saves_requeues_and_finishes(slurm, tmp_path):
    """A job in partition `high` preempts the running job in `low` (PreemptMode=CANCEL, GraceTime=60): the tasks
    get SIGTERM, save and exit 75 within the grace time, the script requeues the job, the high-priority job runs,
    and the requeued job resumes and finishes."""
    iterations = 30
    job_id, log, runs = submit_requeue(slurm, tmp_path, iterations, "--partition=low")
    wait_until(lambda: first_checkpoint(runs), 120, what="first checkpoint")
    high = slurm.sbatch("--partition=high", "--ntasks=2", f"--output={tmp_path / 'high.log'}", "--wrap=sleep 1")
    hold(job_id, signal.SIGTERM, 120)
    job = slurm.finish(job_id, 240, log)
    text = log.read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    assert slurm.job(high)["JobState"] == "COMPLETED"
    assert f"preempted (exit 75): checkpoint saved, requeueing job {job_id}" in text, text
    assert "resuming at iteration" in text, text
    assert_steps_complete(only_run_dir(runs), iterations, PPO)
