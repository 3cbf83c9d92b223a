"""SLURM, for real: a single-host cluster (Debian's slurm-wlm and munge) started once for the test session in a
temporary directory, and real jobs submitted with srun and sbatch: two tasks on one node, and
benchmark/slurm/requeue.sbatch itself through its signal paths (the warning before the time limit,
`scancel --signal=USR1 --full`, a plain `scancel`, a partition preemption). docs/runtime.md, "SLURM", says
what each path does; these tests check it.

One host cannot play a job on two nodes: the requeue onto another node count keeps its stand-ins for srun and
scontrol (tests/test_fault_tolerance.py), and tests/test_runtime.py reads the compressed tasks-per-node layouts
that SLURM gives a job on several nodes.
"""

import math
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
ONE_HOST = ("--nodes=1", "--gpus-per-task=0", "--cpus-per-task=1")  # and --ntasks-per-node


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
        """Poll the job until `condition(job dict)`; fail after `timeout` s with the job, the states it went through
        and its log."""
        deadline, seen = time.monotonic() + timeout, []
        while True:
            job = self.job(job_id)
            if condition(job):
                return job
            state = "/".join(job.get(k, "?") for k in ("JobState", "Reason", "Restarts"))
            seen += [state] if state not in seen[-1:] else []
            if time.monotonic() > deadline:
                text = log.read_text() if log is not None and log.exists() else ""
                went = " -> ".join(seen)
                raise AssertionError(f"job {job_id}: no {what} within {timeout} s ({went}): {job}\n{text}")
            time.sleep(0.2)

    def cancel_all(self, timeout: float = 60) -> None:
        """End every job (running ones by SIGKILL, no grace) and wait until the queue is empty."""
        self.run("scancel", "--signal=KILL", "--full", "--state=RUNNING", "--user=root", check=False)
        self.run("scancel", "--user=root", check=False)
        deadline = time.monotonic() + timeout
        while (queue := self.run("squeue", "-h", check=False).strip()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not queue, f"jobs left after {timeout} s:\n{queue}"

    def finish(self, job_id: int, timeout: float, log: Path) -> dict:
        """Wait until the job has ended for good. A requeued job waits PENDING (Reason=BeginTime) until the old
        attempt's credential has expired (cred_expire, 10 s here, 120 s by default), then for the scheduler's
        next pass: once its begin time has passed, `StartTime=now` starts it (sooner, it would fail)."""

        def ended(job):
            begin = job["StartTime"]  # a pending job's begin time, or "Unknown"
            if job["JobState"] == "PENDING" and begin[:1].isdigit() and datetime.fromisoformat(begin) < datetime.now():
                # a nudge, no more: the scheduler may have started the job since this poll ("Job is no longer
                # pending execution", exit 1), and otherwise starts it at its next pass
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
            return job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")

        return self.wait_for(job_id, ended, timeout, log, "end")


def processes_with(variable: bytes) -> list[int]:
    """The processes whose start-up environment holds `variable` ("NAME=value")."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and variable in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


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
    # a user's shell: no SLURM variables, and no OMP_NUM_THREADS (the suite's own, tests/conftest.py), so that the
    # jobs show the scripts' thread rule
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.pop("OMP_NUM_THREADS", None)
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
        try:  # end every job first: a job's slurmstepd outlives slurmd
            if "slurmctld" in procs and procs["slurmctld"].poll() is None:
                cluster.cancel_all()
        finally:
            stop(procs)
            # a job that started while the cluster went down (a requeue) outlives it: its slurmstepd, shell and
            # tasks, like every process this cluster started, carry its SLURM_CONF
            for pid in processes_with(f"SLURM_CONF={root / 'slurm.conf'}".encode()):
                if pid != os.getpid():
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cluster(slurm):
    """The session's SLURM, with no job of this test left behind (a requeued job would hold the node)."""
    yield slurm
    slurm.cancel_all()


def srun(cluster, *options, timeout=120) -> subprocess.CompletedProcess:
    """`srun OPTIONS python ppo_multigpu.py` (2 iterations), as a user types it."""
    flags = PPO.args(2, tempfile.mkdtemp(dir=cluster.root), nproc=2)
    cmd = ["srun", *options, "python", f"cleanrl_ddp/{PPO.name}", *map(str, flags)]
    env = {**cluster.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "options, threads",
    [
        (["--ntasks=2", "--cpu-bind=none"], "{half} thread(s) per rank ({cores} core(s) / 2 rank(s))"),
        (["--ntasks=2", "--ntasks-per-node=2"], "1 thread(s) per rank (srun bound it to 1 core(s))"),
    ],
    ids=["plain", "ntasks-per-node-bound"],
)
def test_srun_two_tasks_know_their_node_and_threads(cluster, options, threads):
    """Plain `srun --ntasks=2` sets no SLURM_NTASKS_PER_NODE: the ranks still count 2 on the node and share its
    cores; a task that srun bound (task/affinity, its default here: one core per task) takes its own cores. (A
    user's OMP_NUM_THREADS, which srun passes on, wins over both: tests/test_runtime.py's test_threads_per_rank.)"""
    cores = int(cluster.run("sinfo", "-h", "-o", "%c").strip())
    result = srun(cluster, *options)
    assert result.returncode == 0, result.stdout + result.stderr
    threads = threads.format(half=max(1, cores // 2), cores=cores)
    line = f"ppo_multigpu: 2 rank(s) (2 on this node), device cpu, {threads}, backend gloo"
    assert line in result.stdout.splitlines(), result.stdout


def wait_for_checkpoint(cluster: Cluster, job_id: int, log: Path, runs: Path) -> None:
    """Wait for the run's first checkpoint (its tasks have started and handle the signals)."""
    running = ("PENDING", "CONFIGURING", "RUNNING")
    job = cluster.wait_for(job_id, lambda j: first_checkpoint(runs) or j["JobState"] not in running, 180, log, "start")
    text = log.read_text() if log.exists() else ""
    assert first_checkpoint(runs), f"job {job_id} ended before its first checkpoint: {job}\n{text}"


def submit_requeue(cluster, tmp_path, iterations: int, *options, tasks=2) -> tuple[int, Path, Path]:
    """benchmark/slurm/requeue.sbatch, its resource lines overridden for this host, on a tiny ppo_multigpu run of
    `tasks` ranks that checkpoints every iteration; returns the job id, its log and its runs directory."""
    log, runs = tmp_path / "slurm.log", tmp_path / "runs"
    flags = PPO.args(iterations, runs, "--checkpoint-every", 1, nproc=tasks)
    resources = (*ONE_HOST, f"--ntasks-per-node={tasks}")
    job_id = cluster.sbatch(*resources, f"--output={log}", *options, REQUEUE_SBATCH, *flags)
    return job_id, log, runs


def task_pids(cluster: Cluster, job_id: int) -> list[int]:
    """The process ids of the job's tasks: its `python` processes (srun's command line names the script too)."""
    pids = []
    for pid in processes_with(f"SLURM_CONF={cluster.env['SLURM_CONF']}".encode()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone
            continue
        if Path(argv[0].decode()).name.startswith("python") and f"SLURM_JOB_ID={job_id}".encode() in environ:
            pids.append(pid)
    return sorted(pids)


def hold(cluster: Cluster, job_id: int, sig: signal.Signals, timeout: float, then=lambda: None) -> None:
    """Stop the job's tasks (SIGSTOP), call `then`, and let them go on once SLURM has sent them `sig`: the signal
    comes mid-run however fast this machine trains. A task that SLURM continued (it sends SIGCONT with some
    signals), or that has already ended, needs no more waiting."""
    tasks = task_pids(cluster, job_id)
    for pid in tasks:
        os.kill(pid, signal.SIGSTOP)

    def status(pid) -> str:
        try:
            return Path(f"/proc/{pid}/status").read_text()
        except OSError:  # ended
            return "State:\tX (dead)\nShdPnd:\t0\n"

    def stopped(pid) -> bool:
        return re.search(r"^State:\s*[TX]", status(pid), re.M) is not None

    def received(pid) -> bool:
        pending = int(re.search(r"^ShdPnd:\s*(\w+)", status(pid), re.M).group(1), 16)
        return bool(pending & (1 << (sig - 1))) or not stopped(pid)

    try:
        wait_until(lambda: all(stopped(pid) for pid in tasks), 30, what="the tasks stopped")
        then()
        wait_until(lambda: all(received(pid) for pid in tasks), timeout, what=f"{sig.name} from SLURM")
    finally:
        for pid in tasks:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_requeue_sbatch_saves_before_its_time_limit_and_resumes_after_the_requeue(cluster, tmp_path):
    """The file's --signal=USR1@90: SIGUSR1 reaches the tasks before the time limit; they save and exit 75, the
    script requeues the job, and the requeued job resumes in the same run directory and finishes: exit 0, every
    logged step once. The job starts with --time=10; once its tasks run, its time limit is lowered to 1-2
    minutes from now (SLURM checks every 30 s, so the signal comes within a minute; never before the tasks
    handle it, however slowly this machine starts them)."""
    iterations = 30
    job_id, log, runs = submit_requeue(cluster, tmp_path, iterations, "--time=10")
    wait_for_checkpoint(cluster, job_id, log, runs)

    def lower_the_time_limit():
        elapsed = (datetime.now() - datetime.fromisoformat(cluster.job(job_id)["StartTime"])).total_seconds()
        minutes = math.ceil((elapsed + 60) / 60)  # the limit 60 to 120 s from now: the warning is due
        cluster.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}")

    hold(cluster, job_id, signal.SIGUSR1, 120, then=lower_the_time_limit)
    cluster.wait_for(job_id, lambda j: j["JobState"] == "PENDING", 120, log, "requeue")
    # the resumed attempt gets the time to finish: otherwise a busy machine restarts it before it ends
    cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=10")
    job = cluster.finish(job_id, 240, log)
    text = log.read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    assert f"preempted (exit 75): checkpoint saved, requeueing job {job_id}" in text
    assert "resuming at iteration" in text, text
    run_dir = only_run_dir(runs)
    assert run_dir.name.endswith(f"__slurm{job_id}.0")  # the job and its step: a requeue starts again at step 0
    assert load(run_dir / "checkpoint.pt")["global_step"] == iterations * 2 * PPO.local_steps
    assert_steps_complete(run_dir, iterations, PPO)


def test_scancel_signal_usr1_full_saves_and_requeues(cluster, tmp_path):
    """`scancel --signal=USR1 --full` signals the batch shell too: its trap passes the signal on, the tasks save and
    exit 75, and the job is requeued (untrapped, SIGUSR1 would kill the shell and the job end FAILED). One task: the
    signal's path is the same for every task, and the other tests' jobs have two."""
    job_id, log, runs = submit_requeue(cluster, tmp_path, 10_000, tasks=1)
    wait_for_checkpoint(cluster, job_id, log, runs)
    cluster.run("scancel", "--signal=USR1", "--full", str(job_id))
    # the requeue makes the job PENDING at once, and the next scheduling pass gives it the reason BeginTime (held
    # until the old attempt's credential expires): wait for the whole state, not the first poll that sees PENDING
    requeued = lambda j: (j["JobState"], j["Reason"], j["Restarts"]) == ("PENDING", "BeginTime", "1")
    cluster.wait_for(job_id, requeued, 120, log, "requeue (PENDING, Reason=BeginTime, Restarts=1)")
    cluster.run("scancel", str(job_id))  # a pending job: cancelled at once
    text = log.read_text()
    assert "batch script: SIGUSR1, passed on to the tasks" in text, text
    assert f"preempted (exit 75): checkpoint saved, requeueing job {job_id}" in text, text
    assert "preempted by a signal at global step" in text, text


def test_plain_scancel_saves_and_stops_without_a_requeue(cluster, tmp_path):
    """A plain `scancel JOB` sends SIGTERM to the tasks and the batch shell: the tasks save and exit 75 within
    KillWait, and the script does not requeue a cancelled job (else scancel could never stop a run). One
    task, as above."""
    job_id, log, runs = submit_requeue(cluster, tmp_path, 10_000, tasks=1)
    wait_for_checkpoint(cluster, job_id, log, runs)
    cluster.run("scancel", str(job_id))
    job = cluster.wait_for(job_id, lambda j: j["JobState"] not in ("RUNNING", "COMPLETING"), 120, log, "end")
    wait_until(lambda: "not requeued" in log.read_text(), 30, what="the script's last line")
    text = log.read_text()
    assert (job["JobState"], job["Restarts"]) == ("CANCELLED", "0"), job
    assert f"cancelled (exit 75): checkpoint saved, job {job_id} not requeued" in text, text
    step = int(re.search(r"preempted by a signal at global step (\d+)", text).group(1))
    assert load(only_run_dir(runs) / "checkpoint.pt")["global_step"] == step


def test_preempted_by_a_higher_priority_partition_saves_requeues_and_finishes(cluster, tmp_path):
    """A job in partition `high` preempts the running job in `low` (PreemptMode=CANCEL, GraceTime=60): the tasks
    get SIGTERM, save and exit 75 within the grace time, the script requeues the job, the high-priority job runs,
    and the requeued job resumes and finishes."""
    iterations = 30
    job_id, log, runs = submit_requeue(cluster, tmp_path, iterations, "--partition=low")
    wait_for_checkpoint(cluster, job_id, log, runs)
    # the high-priority job is submitted once the tasks are stopped (hold's `then`): submitted before, SLURM's
    # SIGTERM could reach the running tasks first, and they would save and exit before `hold` looked (seen once
    # in a full suite run: "no SIGTERM from SLURM within 120 s")
    high = []
    submit = lambda: high.append(
        cluster.sbatch("--partition=high", "--exclusive", f"--output={tmp_path / 'high.log'}", "--wrap=sleep 1")
    )
    hold(cluster, job_id, signal.SIGTERM, 120, then=submit)
    job = cluster.finish(job_id, 240, log)
    text = log.read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    assert cluster.job(high[0])["JobState"] == "COMPLETED"
    assert f"preempted (exit 75): checkpoint saved, requeueing job {job_id}" in text, text
    assert "resuming at iteration" in text, text
    assert_steps_complete(only_run_dir(runs), iterations, PPO)
