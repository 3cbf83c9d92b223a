"""The nine distributed guarantees of docs/correctness.md, proven for every script in `SCRIPTS`.

Two kinds of test, both on CPU with gloo and the real `torchrun`:
- unit: `tests/dist_worker.py unit` imports the script's own network, loss (ppo_loss, or DQN's td_loss),
  all_reduce_gradients_flat and check_replicas_in_sync and compares a 2-rank update with the single-process
  one (guarantees 3, 4; tests/unit_updates.py); one launch for all scripts;
- whole script: `tests/dist_worker.py batch` runs the unchanged script under `torchrun` and records from
  outside what every rank did (guarantees 1, 2, 5-9; tests/observed_runs.py); the unit-level launch also runs the
  real `main()` of the scripts with --compile and records what torch.compile traced (tests/compiled_runs.py).
A new script is covered by adding one `ScriptSpec` to `SCRIPTS` in tests/script_specs.py.
"""

import functools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch
from graph_capture import differences
from helpers import (
    REPO,
    assert_one_line_error,
    batch_exit_codes,
    batch_job,
    batch_output,
    free_port,
    launch,
    launch_batch,
    only_run_dir,
    read_scalars,
)
from script_specs import SCRIPTS

WORKER = REPO / "tests" / "dist_worker.py"
TIMEOUT = 240  # seconds per launch; a hang (e.g. ranks issuing different collectives) fails the test
COMMON = ["--dist-timeout", "60", "--seed", "7"]  # a desynchronised collective errors out within a minute


# Whole runs with their randomness pinned (`pinned` in tests/observed_runs.py), by (script, gradient path, world size):
# the env count of the runs at other world sizes that must make the same run (pqn_multigpu.py's 3-rank run is also
# test_pqn_whole_runs_at_1_2_and_3_ranks_are_the_same_run's)
PINNED = {("pqn_multigpu.py", "flat", 3): 6}
# the scripts whose resume is bitwise (their envs are saved as data): tests/test_fault_tolerance.py's SIGTERM test
# proves them reproducible (guarantee 9, below)
RESUMED_BITWISE = ("ppo_multigpu.py", "ppo_continuous_action_multigpu.py", "pqn_multigpu.py")


class Run:
    """One whole-script run under tests/dist_worker.py (`mode`: observe, diverge, pinned or plain), read back once
    for several tests. The runs of one `group` are launched together (`batch` in tests/dist_worker.py): in the same
    processes one after another, each in a process group of its own, so that the ranks start once for all."""

    def __init__(self, group, spec, nproc, args, outdir: Path, mode="observe", global_envs=0):
        self.group, self.spec, self.world_size, self.outdir = group, spec, max(nproc, 1), outdir
        self.nproc, self.mode, self.runs_dir = nproc, mode, outdir / "runs"
        self.job = batch_job(spec.script, [*args, "--runs-dir", self.runs_dir], outdir, mode, global_envs)

    @classmethod
    def whole(cls, group, spec, grad_sync: str, nproc: int, outdir: Path, mode="observe"):
        """The run that guarantees 1, 2 and 5-7 read: several iterations, the replicas compared at every one."""
        iterations, batch_size = spec.iterations[nproc], nproc * spec.local_batch  # env steps of all ranks
        total = iterations * batch_size + min(batch_size // 2 + 3, batch_size - 1)  # not a multiple of the batch
        flags = ["--grad-sync", grad_sync, "--total-timesteps", total, "--sync-check-every", "1"]
        flags += ["--torch-deterministic"]
        pinned = PINNED.get((spec.script, grad_sync, nproc), 0)
        run = cls(group, spec, nproc, [*spec.tiny, *COMMON, *flags], outdir, "pinned" if pinned else mode, pinned)
        run.iterations, run.batch_size, run.total, run.flags = iterations, batch_size, total, flags
        return run

    def read(self, proc):
        """What the batch launch `proc` left of this run."""
        self.proc = proc
        self.exit_codes = batch_exit_codes(self.outdir, self.world_size)
        self.output = batch_output(self.outdir, self.world_size)

    @functools.cached_property
    def ranks(self) -> list[dict] | None:
        """What each rank recorded, written also when the run fails (None for a plain run). Missing where the launch
        stopped before the run began: then what the launch printed says why."""
        if self.mode == "plain":
            return None
        files = sorted(self.outdir.glob("rank*.pt"))
        assert len(files) == self.world_size, f"{files}; the launch printed:\n{self.proc.stdout}{self.proc.stderr}"
        return [torch.load(self.outdir / f"rank{r}.pt", weights_only=True) for r in range(self.world_size)]

    def assert_finished(self):
        assert self.proc.returncode == 0, self.proc.stdout + self.proc.stderr
        assert self.exit_codes == [0] * self.world_size, self.output
        self.run_dir = only_run_dir(self.runs_dir)
        return self


def plan(tmp_path_factory) -> dict:
    """Every whole-script run of this module by key, each in its launch group."""
    runs = {}

    def outdir(*key):
        return tmp_path_factory.mktemp("-".join(str(k).removesuffix(".py") for k in key))

    for script, spec in SCRIPTS.items():
        for grad_sync, nproc in spec.whole_runs:
            runs["whole", script, grad_sync, nproc] = Run.whole(nproc, spec, grad_sync, nproc, outdir(script, nproc))
        if spec.target_kl:  # 4 iterations
            flags = [*spec.tiny, *COMMON, "--total-timesteps", 4 * 2 * spec.local_batch, *spec.target_kl]
            runs["target_kl", script] = Run(2, spec, 2, flags, outdir(script, "target-kl"))
        if spec.two_nodes:  # a parameter nudged on rank 1 after its 2nd optimizer step (iteration 1), checked at 2
            every = 2 * 2 * spec.local_batch  # the global steps of 2 iterations
            flags = [*spec.tiny, *COMMON, "--total-timesteps", 4 * 2 * spec.local_batch, "--sync-check-every", every]
            runs["diverge", script] = Run(2, spec, 2, flags, outdir(script, "diverge"), mode="diverge")
            runs["two_nodes", script] = Run.whole("two nodes", spec, "ddp", 2, outdir(script, "two-nodes"))
        if script not in RESUMED_BITWISE:  # the 2-rank run's command again, nothing recorded, in the two-node launch
            runs["again", script, "ddp", 2] = Run.whole("two nodes", spec, "ddp", 2, outdir(script, "again"), "plain")
    # the continuous PPO on Hopper-v5, 4 iterations of 2 envs in all
    spec = SCRIPTS["ppo_continuous_action_multigpu.py"]
    flags = ["--env-id", "Hopper-v5", "--num-steps", "64", "--num-minibatches", "4", "--update-epochs", "2"]
    flags += ["--seed", "3", "--total-timesteps", "512", "--checkpoint-every", "0"]
    for world_size, nproc in ((2, 2), (1, 0)):  # nproc 0: plain python, no torchrun
        args = [*flags, "--local-num-envs", 2 // world_size]
        runs["pinned", spec.script, world_size] = Run(
            nproc, spec, nproc, args, outdir(spec.script, world_size), "pinned", 2
        )
    # PQN's 3-rank run's flags at 1 and 2 ranks, the last of a repeated flag winning: DDP, its 6 envs over them
    three = runs["whole", "pqn_multigpu.py", "flat", 3]
    for world_size, nproc in ((2, 2), (1, 0)):
        args = [*three.spec.tiny, *COMMON, *three.flags, "--grad-sync", "ddp", "--local-num-envs", 6 // world_size]
        runs["pinned", three.spec.script, world_size] = Run(
            nproc, three.spec, nproc, args, outdir(three.spec.script, world_size), "pinned", 6
        )
    return runs


_plan, _launched = {}, set()
# one thread per rank in every launch: the pinned runs compare with one process on one thread, and the runs again
# with the runs of the same flags on one node (1 and 2 threads round the orthogonal init's QR differently)
ONE_THREAD = dict(OMP_NUM_THREADS="1")


def get_run(tmp_path_factory, *key) -> Run:
    """The run of `key` (see `plan`), its group launched the first time that one of its runs is asked for."""
    if not _plan:
        _plan.update(plan(tmp_path_factory))
    run = _plan[key]
    if run.group not in _launched:
        _launched.add(run.group)
        group = [r for r in _plan.values() if r.group == run.group]
        jobs, jobs_file = [r.job for r in group], tmp_path_factory.mktemp("batch") / "jobs.json"
        timeout = TIMEOUT + 60 * len(group)  # a hang (ranks issuing different collectives) still fails
        if run.group == "two nodes":  # two torchrun launches, one process each, meeting at a static rendezvous
            port = free_port()

            def node(node_rank):
                torchrun = ["--nnodes=2", "--nproc_per_node=1", f"--node_rank={node_rank}"]
                torchrun += ["--master_addr=127.0.0.1", f"--master_port={port}"]
                return launch_batch(jobs, None, jobs_file, timeout, env=ONE_THREAD, torchrun_args=torchrun)

            with ThreadPoolExecutor(2) as pool:
                procs = list(pool.map(node, [0, 1]))
            proc = procs[0] if procs[0].returncode else procs[1]
        else:
            proc = launch_batch(jobs, run.group, jobs_file, timeout, env=ONE_THREAD)
        for r in group:
            r.read(proc)
    return run


RUNS = [(script, grad_sync, nproc) for script, spec in SCRIPTS.items() for grad_sync, nproc in spec.whole_runs]


@pytest.fixture(params=RUNS, ids=[f"{s[:-3]}-{g}-{n}ranks" for s, g, n in RUNS])
def run(request, tmp_path_factory):
    return get_run(tmp_path_factory, "whole", *request.param)


@pytest.fixture(scope="module")
def unit_dir(tmp_path_factory):
    """One launch of the unit-level worker on 2 ranks, for every script in turn, then the --compile runs."""
    outdir = tmp_path_factory.mktemp("unit")
    scripts = list(SCRIPTS)
    others = [REPO / "cleanrl_ddp" / s for s in scripts[1:]]
    # its runs are many: 73 s alone, 180-200 s in a whole run on the 2-core machine, more when that machine is slow
    proc = launch(scripts[0], others, nproc=2, timeout=2 * TIMEOUT, wrapper=[WORKER, "unit", outdir])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return outdir


UNIT = [s for s, spec in SCRIPTS.items() if not (spec.sac or spec.td3)]  # theirs: `unit_sac`, `unit_td3` below


@pytest.fixture(params=UNIT, ids=[s[:-3] for s in UNIT])
def unit(request, unit_dir):
    """The unit-level results of one script: a list of per-rank result dicts."""
    return [json.loads((unit_dir / f"{request.param[:-3]}_unit_rank{r}.json").read_text()) for r in range(2)]


def per_script(select=lambda spec: True):
    scripts = [s for s, spec in SCRIPTS.items() if select(spec)]
    return dict(argnames="script", argvalues=scripts, ids=[s[:-3] for s in scripts])


def assert_all_equal(tensors, what):
    for r, t in enumerate(tensors[1:], start=1):
        assert torch.equal(t, tensors[0]), (
            f"{what}: rank {r} differs from rank 0 (max abs diff {(t - tensors[0]).abs().max()})"
        )


def assert_state_dicts_equal(a, b, what):
    assert a.keys() == b.keys(), what
    for key in a:
        if isinstance(a[key], dict):
            assert_state_dicts_equal(a[key], b[key], f"{what}[{key}]")
        elif torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), f"{what}[{key}] differs"
        else:
            assert a[key] == b[key], f"{what}[{key}]: {a[key]} != {b[key]}"


# 1. Same start
def test_same_start(run):
    if any(r["params_before_first_update"] is None for r in run.ranks):  # no update at all: why?
        run.assert_finished()
        pytest.fail("the run finished without an optimizer step")
    assert_all_equal([r["params_before_first_update"] for r in run.ranks], "parameters before the first update")
    if run.spec.target_classes:  # and the target networks, copies of the online ones (TD3: actor and critics)
        targets = [r["targets_before_first_update"] for r in run.ranks]
        count = len(run.spec.target_classes)
        assert [len(t) for t in targets] == [count] * run.world_size, [len(t) for t in targets]
        for i, name in enumerate(run.spec.target_classes):
            assert_all_equal([t[i] for t in targets], f"target {name} before the first update")
            assert torch.equal(targets[0][i], run.ranks[0]["online_before_first_update"][i]), name


# 2. No drift
def test_no_drift(run):
    steps = [r["optimizer_steps"] for r in run.ranks]
    assert len(set(steps)) == 1, steps
    assert_all_equal([r["final_params"] for r in run.ranks], "final parameters")
    for r in run.ranks[1:]:
        assert_state_dicts_equal(r["final_optimizer"], run.ranks[0]["final_optimizer"], "optimizer state")
    run.assert_finished()  # and --sync-check-every 1 found no difference at any iteration
    assert steps[0] >= 16, steps  # many updates
    assert not torch.equal(run.ranks[0]["final_params"], run.ranks[0]["params_before_first_update"])
    if run.spec.sac or run.spec.td3:  # every learned quantity: critics, actor (and SAC's log_alpha), with optimizers
        optimised = ("critics", "actor", "log_alpha") if run.spec.sac else ("critics", "actor")
        finals = [r["final_params_by_optimizer"] for r in run.ranks]
        assert [len(f) for f in finals] == [len(optimised)] * run.world_size, [len(f) for f in finals]
        for i, what in enumerate(optimised):
            assert_all_equal([f[i] for f in finals], f"final {what}")
            for r in run.ranks[1:]:
                assert_state_dicts_equal(r["final_optimizers"][i], run.ranks[0]["final_optimizers"][i], what)
        assert run.spec.td3 or not torch.equal(finals[0][2], torch.zeros(1)), "log_alpha never moved"
    for i, name in enumerate(run.spec.target_classes):  # the target networks too, synced at least once
        assert_all_equal([r["final_targets"][i] for r in run.ranks], f"final target {name}")
        assert not torch.equal(run.ranks[0]["final_targets"][i], run.ranks[0]["targets_before_first_update"][i])


# 3. Equivalence: 2 ranks with their local minibatches == 1 process on the union
@pytest.mark.parametrize("grad_sync", ["ddp", "flat"])
def test_equivalence_with_single_process(unit, grad_sync):
    for r in unit:
        assert r["world_size"] == 2 and r[f"{grad_sync}_moved"] > 1e-3
        assert max(r[f"{grad_sync}_grad_rel_err"]) < 1e-5, r  # averaged gradient of each of 3 minibatches
        # parameter change after 3 Adam steps (gradients clipped in the PPO scripts)
        assert r[f"{grad_sync}_update_rel_err"] < SCRIPTS[r["script"]].update_rtol, r
        if SCRIPTS[r["script"]].pqn:  # PQN: RAdam; every update's gradient clipped, so the clip saw the averaged one
            assert r["clipped_updates"] == 3, r


# 3b. Equivalence of whole runs: every statistic the iteration merges, not only the update
def test_whole_run_equivalence_with_single_process(tmp_path_factory):
    """ppo_continuous_action_multigpu.py on Hopper-v5, 4 iterations: 2 ranks x 1 env equal 1 process x 2 envs.

    With the action noise and the minibatches pinned (`pinned` in tests/observed_runs.py), both runs see the same
    env data, so everything the iteration computes from all ranks' samples must agree: the observation and return
    statistics (RunningStats merges), reward scaling, GAE, advantage normalisation, averaged gradients, the
    learning-rate schedule and the logged metrics. Measured: final parameters 7.2e-7 apart relative to how far
    they moved; with any one of the three merges made local, 7e-2 to 1e-1. Both runs on one thread (`get_run`):
    the orthogonal init's QR differs in the last bits between 1 and 2 threads (seen: 2,649 of 10,119 initial
    weights, up to 1.8e-7).
    """
    script, runs = "ppo_continuous_action_multigpu.py", {}
    for world_size in (2, 1):
        run = get_run(tmp_path_factory, "pinned", script, world_size).assert_finished()
        runs[world_size] = run.ranks[0], read_scalars(run.run_dir)
    (two, two_scalars), (one, one_scalars) = runs[2], runs[1]
    moved = (one["final_params"] - one["params_before_first_update"]).norm()
    assert moved > 0.1 and torch.equal(two["params_before_first_update"], one["params_before_first_update"])
    assert two["optimizer_steps"] == one["optimizer_steps"] == 4 * 4 * 2
    assert (two["final_params"] - one["final_params"]).norm() / moved < 1e-5
    assert sum(v for _, v in one_scalars["charts/episodes"]) >= 8  # Hopper falls: GAE and the stats see episode ends
    for tag in ("charts/episodic_return", "norm/obs_std_mean", "norm/return_std", "losses/value_loss"):
        assert [s for s, _ in two_scalars[tag]] == [s for s, _ in one_scalars[tag]], tag
        assert [v for _, v in two_scalars[tag]] == pytest.approx([v for _, v in one_scalars[tag]], rel=1e-4), tag


# 3c. PQN's whole runs: 2 ranks (DDP) and 3 ranks (flat) equal one process with all their envs
def test_pqn_whole_runs_at_1_2_and_3_ranks_are_the_same_run(tmp_path_factory):
    """pqn_multigpu.py on CartPole-v1, 6 envs in all, 4 iterations of 16 steps: 1 process x 6 envs, 2 ranks x 3
    (DDP) and 3 ranks x 2 (--grad-sync flat: the flat-3ranks whole run above). With the exploration draws and the
    minibatches pinned (`pinned` in tests/observed_runs.py) every world size sees the same env data, so everything the
    iteration computes must agree: epsilon and the learning rate from the global step, each env's Q(lambda) returns on
    the rank that stepped it, the averaged (then clipped) gradients, and the metrics reduced over all ranks by name."""
    runs = {}
    for key in (
        ("whole", "pqn_multigpu.py", "flat", 3),
        ("pinned", "pqn_multigpu.py", 2),
        ("pinned", "pqn_multigpu.py", 1),
    ):
        run = get_run(tmp_path_factory, *key).assert_finished()
        runs[run.world_size] = run.ranks[0], read_scalars(run.run_dir)
    one, one_scalars = runs[1]
    moved = (one["final_params"] - one["params_before_first_update"]).norm()
    assert moved > 0.005 and one["optimizer_steps"] == 4 * 2 * 2
    assert sum(v for _, v in one_scalars["charts/episodes"]) >= 8  # episodes end: the returns are cut there
    for world_size in (2, 3):
        other, scalars = runs[world_size]
        assert torch.equal(other["params_before_first_update"], one["params_before_first_update"])
        assert other["optimizer_steps"] == one["optimizer_steps"]
        assert (other["final_params"] - one["final_params"]).norm() / moved < 1e-5, world_size
        for tag in ("charts/epsilon", "charts/learning_rate", "charts/episodic_return", "losses/td_loss"):
            assert [s for s, _ in scalars[tag]] == [s for s, _ in one_scalars[tag]], (world_size, tag)
            expected = [v for _, v in one_scalars[tag]]
            assert [v for _, v in scalars[tag]] == pytest.approx(expected, rel=1e-4), (world_size, tag)


# 4. Paths agree
def test_ddp_and_flat_paths_agree(unit):
    for r in unit:
        assert r["ddp_vs_flat_update_rel_err"] < 1e-6, r


# Logged metrics are the reduction over all ranks, not rank 0's own numbers
@pytest.mark.parametrize("script", ["ppo_multigpu.py", "ppo_continuous_action_multigpu.py"])
def test_logged_losses_and_episodes_are_reduced_over_all_ranks(tmp_path_factory, script):
    """Each rank's own episodes and loss-forward entropies, recorded from outside, give the logged values:
    charts/episodic_return is the mean over every rank's finished episodes, losses/entropy the mean over
    ranks of each rank's mean over its minibatches; rank 0's own numbers differ from both."""
    run = get_run(tmp_path_factory, "whole", script, "ddp", 2).assert_finished()
    scalars = read_scalars(run.run_dir)
    local_steps = run.spec.local_batch  # this rank's env steps per iteration
    checked = 0
    for step, logged in scalars["losses/entropy"]:
        end = step // run.world_size  # each rank's env steps at the end of this iteration
        own = [[e for s, e in r["loss_entropies"] if s == end] for r in run.ranks]
        assert all(own), (step, own)
        means = [sum(e) / len(e) for e in own]
        assert logged == pytest.approx(sum(means) / len(means), rel=1e-5), step
        checked += any(m != pytest.approx(means[0], rel=1e-5) for m in means[1:])
    if script == "ppo_multigpu.py":  # the continuous policy's entropy is its (shared) log-std's: equal on every rank
        assert checked, "no iteration where the ranks' own entropies differ (the test could not tell)"
    differs = 0
    for step, logged in scalars.get("charts/episodic_return", []):
        end = step // run.world_size
        own = [[(ret, n) for s, ret, n in r["episodes"] if end - local_steps < s <= end] for r in run.ranks]
        every = [ret for episodes in own for ret, _ in episodes]
        assert logged == pytest.approx(sum(every) / len(every), rel=1e-5), step
        assert sum(len(e) for e in own) == dict(scalars["charts/episodes"])[step]
        differs += bool(own[0]) and sum(r for r, _ in own[0]) / len(own[0]) != pytest.approx(logged, rel=1e-5)
    assert differs, "no iteration where rank 0's own episodes differ from all ranks' (the test could not tell)"


# --sync-check-every: the checksum comparison names the diverged rank, for parameters and optimizer state
def test_sync_check_names_the_diverged_rank(unit):
    for r in unit:
        assert r["sync_check_in_sync"] is None and r["sync_check_restored"] is None, r
        for what in ("param", "exp_avg", *(["target"] if "sync_check_target_nudged" in r else [])):
            message = r[f"sync_check_{what}_nudged"] or f"one ulp of {what} on rank 1 went unnoticed"
            assert message.startswith("replicas diverged at iteration 7: rank(s) [1] "), message


@pytest.mark.parametrize(**per_script(lambda spec: spec.two_nodes))
def test_sync_check_stops_a_diverged_run(tmp_path_factory, script):
    """A parameter nudged on rank 1 after its 2nd optimizer step (iteration 1) stops the run at iteration 2."""
    run = get_run(tmp_path_factory, "diverge", script)
    assert run.exit_codes == [3, 3] and [r["exit_code"] for r in run.ranks] == [3, 3], run.output
    stopped = CompletedProcess([], 3, run.output, "")
    assert_one_line_error(stopped, r"replicas diverged at iteration 2: rank\(s\) \[1\]", script)


# 5. Different data
def test_different_data(run):
    seeds = [s for r in run.ranks for reset in r["reset_seeds"] for s in reset]
    assert None not in seeds and len(seeds) == len(set(seeds)), [r["reset_seeds"] for r in run.ranks]
    local_envs = int(run.spec.tiny[run.spec.tiny.index("--local-num-envs") + 1])
    assert len(seeds) >= run.world_size * local_envs  # every env of every rank was seeded
    for stream in ("torch", "numpy", "python"):
        states = [r["rng_at_first_step"][stream] for r in run.ranks]
        assert len(set(states)) == run.world_size, f"{stream} sampling streams shared between ranks: {states}"
    actions = [tuple(map(tuple, r["actions"])) for r in run.ranks]
    assert len(set(actions)) == run.world_size, "two ranks sampled the same actions"


# 6. Global accounting
def test_global_accounting(run):
    run.assert_finished()
    consumed = sum(r["env_steps"] for r in run.ranks)
    assert [r["env_steps"] for r in run.ranks] == [consumed // run.world_size] * run.world_size
    assert consumed == run.iterations * run.batch_size <= run.total
    scalars = read_scalars(run.run_dir)
    assert max(step for events in scalars.values() for step, _ in events) == consumed
    ckpt = torch.load(run.run_dir / "checkpoint.pt", weights_only=True)
    assert ckpt["global_step"] == consumed and ckpt["iteration"] == run.iterations


# 7. Same schedule under --target-kl
@pytest.mark.parametrize(**per_script(lambda spec: bool(spec.target_kl)))
def test_same_schedule_under_target_kl(tmp_path_factory, script):
    spec, iterations = SCRIPTS[script], 4
    ranks = get_run(tmp_path_factory, "target_kl", script).assert_finished().ranks
    steps = [r["optimizer_steps"] for r in ranks]
    epochs = int(spec.target_kl[spec.target_kl.index("--update-epochs") + 1])
    minibatches = int(spec.tiny[spec.tiny.index("--num-minibatches") + 1])
    assert steps[0] == steps[1] < iterations * epochs * minibatches, steps  # stopped early, together
    assert_all_equal([r["final_params"] for r in ranks], "final parameters")


# 7. Same schedule: every rank updates at the same env steps; DQN's updates and target syncs follow the global step
def test_same_schedule(run):
    run.assert_finished()
    schedules = [r["update_env_steps"] for r in run.ranks]
    assert all(s == schedules[0] for s in schedules), schedules
    if run.spec.sac or run.spec.td3:
        return assert_actor_critic_schedule(run, schedules[0])
    if not run.spec.dqn:
        return
    syncs = [r["target_sync_env_steps"] for r in run.ranks]
    assert all(s == syncs[0] for s in syncs), syncs
    tiny = run.spec.tiny

    def flag(name):
        return int(tiny[tiny.index(name) + 1])

    # global step g = local env steps x world size; updates: one per multiple of --train-frequency passed after
    # --learning-starts, target syncs one per multiple of --target-network-frequency passed (tau = 1: a copy)
    n, start = run.batch_size, flag("--learning-starts")
    expected_updates, expected_syncs = [], []
    for g in range(n, run.iterations * n + 1, n):
        if g > start:
            local = g // run.world_size
            expected_updates += [local] * (g // flag("--train-frequency") - (g - n) // flag("--train-frequency"))
            expected_syncs += [local] * (
                g // flag("--target-network-frequency") > (g - n) // flag("--target-network-frequency")
            )
    assert schedules[0] == expected_updates and len(expected_updates) >= 16, (schedules[0], expected_updates)
    assert syncs[0] == expected_syncs and len(expected_syncs) >= 2, (syncs[0], expected_syncs)
    ckpt = torch.load(run.run_dir / "checkpoint.pt", weights_only=True)
    assert (ckpt["num_updates"], ckpt["num_target_updates"]) == (len(expected_updates), len(expected_syncs))


def assert_actor_critic_schedule(run, schedule):
    """SAC and TD3: --updates-per-iteration critic steps per iteration once the global step passes --learning-starts.
    SAC: after every --policy-frequency-th critic update as many actor and log_alpha steps; the target critics after
    every update. TD3: after every --policy-frequency-th critic update one actor step, then the targets."""
    tiny = run.spec.tiny

    def flag(name):
        return int(tiny[tiny.index(name) + 1])

    n, start, per_iteration, delay = run.batch_size, flag("--learning-starts"), flag("--updates-per-iteration"), 2
    expected, expected_syncs, updates = [], [], 0
    for g in range(n, run.iterations * n + 1, n):
        if g > start:
            local = g // run.world_size
            for _ in range(per_iteration):
                updates += 1
                expected.append(local)  # the critics
                if updates % delay == 0:
                    expected += [local] * (2 * delay if run.spec.sac else 1)  # SAC: actor and log_alpha, `delay` times
            expected_syncs.append(local)  # the targets change in each such iteration (seen once per iteration)
    assert schedule == expected and updates >= 16, (schedule, expected)
    syncs = [r["target_sync_env_steps"] for r in run.ranks]
    assert all(s == expected_syncs for s in syncs), (syncs, expected_syncs)
    ckpt = torch.load(run.run_dir / "checkpoint.pt", weights_only=True)
    actor_updates = updates // delay * (delay if run.spec.sac else 1)
    assert (ckpt["num_updates"], ckpt["num_actor_updates"]) == (updates, actor_updates)


# SAC: the 2-rank update equals the single-process one on the union of the minibatches, for the critics, the
# actor AND log_alpha (which no DDP wrapper holds); the target critics follow; ddp == flat
@pytest.fixture(scope="module")
def unit_sac(unit_dir):
    return [json.loads((unit_dir / f"sac_continuous_action_multigpu_unit_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("grad_sync", ["ddp", "flat"])
def test_sac_equivalence_with_single_process(unit_sac, grad_sync):
    for r in unit_sac:
        assert r["world_size"] == 2 and r["noise_calls"] == 12, r
        for name in ("qf", "actor", "log_alpha"):
            assert len(r[f"{grad_sync}_{name}_grad_rel_err"]) == 4, r  # 4 critic updates, 2 x 2 actor/alpha ones
            assert max(r[f"{grad_sync}_{name}_grad_rel_err"]) < 1e-5, (name, r)
        for name in ("qf", "actor", "log_alpha", "qf_target"):
            assert r[f"{grad_sync}_{name}_moved"] > 1e-3, (name, r)
            assert r[f"{grad_sync}_{name}_update_rel_err"] < SCRIPTS[r["script"]].update_rtol, (name, r)


def test_sac_ddp_and_flat_paths_agree(unit_sac):
    for r in unit_sac:
        for name in ("qf", "actor", "log_alpha", "qf_target"):
            assert r[f"ddp_vs_flat_{name}_update_rel_err"] < 1e-6, (name, r)


# TD3: the 2-rank update equals the single-process one on the union of the minibatches, for the critics and the
# actor; the target actor and critics follow; ddp == flat
@pytest.fixture(scope="module")
def unit_td3(unit_dir):
    return [json.loads((unit_dir / f"td3_continuous_action_multigpu_unit_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("grad_sync", ["ddp", "flat"])
def test_td3_equivalence_with_single_process(unit_td3, grad_sync):
    for r in unit_td3:
        assert r["world_size"] == 2 and r["noise_calls"] == 4, r  # one smoothing draw per critic update
        for name, count in (("qf", 4), ("actor", 2)):  # 4 critic updates, an actor update after every 2nd
            assert len(r[f"{grad_sync}_{name}_grad_rel_err"]) == count, r
            assert max(r[f"{grad_sync}_{name}_grad_rel_err"]) < 1e-5, (name, r)
        for name in ("qf", "actor", "qf_target", "target_actor"):
            assert r[f"{grad_sync}_{name}_moved"] > 1e-4, (name, r)
            assert r[f"{grad_sync}_{name}_update_rel_err"] < SCRIPTS[r["script"]].update_rtol, (name, r)


def test_td3_ddp_and_flat_paths_agree(unit_td3):
    for r in unit_td3:
        for name in ("qf", "actor", "qf_target", "target_actor"):
            assert r[f"ddp_vs_flat_{name}_update_rel_err"] < 1e-6, (name, r)


# --compile under CUDA graphs (mode reduce-overhead) replays captured memory, so a compiled call must hold no
# collective, mutate no input and allocate no gradient that outlives it, and its outputs must not be read after the
# next compiled call (docs/correctness.md). The real script's main() with --compile on 2 ranks, DDP and flat, inside
# the unit launch (`compiled_run` in tests/compiled_runs.py): each torch.compile'd function traced by a recording
# backend (AOTAutograd with compilers that list each graph's ops and run it as traced).
COMPILED = [(s, grad_sync) for s, spec in SCRIPTS.items() if spec.compiled for grad_sync in ("ddp", "flat")]


@pytest.fixture(params=COMPILED, ids=[f"{s[:-3]}-{g}" for s, g in COMPILED])
def compiled(request, unit_dir):
    """(ScriptSpec, gradient path, what each rank's --compile run recorded, rank 0's checkpoints of the --compile run
    and of the same command's eager run)."""
    script, grad_sync = request.param
    ranks = [json.loads((unit_dir / f"{script[:-3]}_compiled_{grad_sync}_rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["error"] is None and r["eager_error"] is None, r["error"] or r["eager_error"]
    runs = unit_dir / f"runs-{script[:-3]}-{grad_sync}"
    ckpts = [torch.load(f"{runs}{kind}/r/checkpoint.pt", weights_only=True) for kind in ("", "-eager")]
    return SCRIPTS[script], grad_sync, ranks, ckpts


def test_compile_traces_the_losses_without_collectives(compiled):
    """Exactly the losses are compiled, each into Dynamo, forward and backward graphs; no graph holds a collective
    (DDP's all-reduces run from its autograd hooks, the flat one after backward) or mutates an input; the only graph
    breaks are DDP's: DDPOptimizer's splits at bucket boundaries, and DDP's forward, whose reducer set-up Dynamo does
    not trace."""
    spec, grad_sync, ranks, _ = compiled
    for r in ranks:
        assert sorted(r["compiled"]) == sorted(spec.compiled), r["compiled"]
        for name, graphs in r["compiled"].items():
            assert min(graphs.values()) >= 1, (name, graphs)  # Dynamo, forward and backward graphs, and calls
        assert r["collectives"] == [], r["collectives"]
        assert r["mutated_inputs"] == [], r["mutated_inputs"]
        allowed = {"DDPOptimizer", "DistributedDataParallel"} if grad_sync == "ddp" else set()
        assert {site for site, _ in r["graph_breaks"]} <= allowed, r["graph_breaks"]


def test_compile_gradients_allocated_once(compiled):
    """Every parameter of every optimizer has its gradient before the first compiled call, and it keeps its storage
    (and the parameter's strides: channels-last in the Atari PPO) at every optimizer step: backward accumulated into
    it, never handing a tensor of the compiled backward to `.grad`."""
    _, _, ranks, _ = compiled
    for r in ranks:
        assert r["grads_missing"] == [], r["grads_missing"]
        assert r["optimizer_steps"] >= 4 and r["grads_moved"] == [], r["grads_moved"]
        assert r["grad_strides_differ"] == [], r["grad_strides_differ"]


def test_compile_outputs_read_before_the_next_compiled_call(compiled):
    """No output of a compiled call (nor a tensor sharing its memory) is read once the next compiled call has begun:
    CUDA graph trees may overwrite it by then ("accessing tensor output of CUDAGraphs that has been overwritten by a
    subsequent run"). The eager code is watched by a torch function mode."""
    _, _, ranks, _ = compiled
    for r in ranks:
        assert r["stale_reads"] == [], r["stale_reads"]


def test_compile_optimizers_fused(compiled):
    """Every optimizer is fused Adam: its step counter lives on the parameters' device, a resumed one too."""
    spec, _, ranks, _ = compiled
    for r in ranks:
        assert r["fused"] == [True] * (3 if spec.sac else 2 if spec.td3 else 1), r["fused"]


def test_compile_runs_equal_eager(compiled):
    """The --compile run ends bitwise where the same command without it does, at 2 ranks under DDP and flat (flat
    compiles the losses as world size 1 does: no DDP wrapper): every entry of the final checkpoints' training state
    (networks, optimizer state, step counters, every rank's RNG streams)."""
    _, _, _, (run, eager) = compiled
    assert run["global_step"] == eager["global_step"] > 0
    assert differences(eager, run) == []


# --cudagraphs (docs/correctness.md): the real main() on the 2 ranks of the unit launch, eagerly under DDP,
# then with --cudagraphs under DDP and with --grad-sync flat, each function that a CUDA device would capture recorded
# by tests/graph_capture.py (`captured_runs` in tests/captured_runs.py): no collective inside a graph, nothing that
# outlives a call (gradients, optimizer state) made by the capture or moved after it, and both runs bitwise the eager
# one, so DDP under CUDA graphs equals the flat all-reduce. World size 1 is tests/test_cudagraphs.py's.
CAPTURED = [(s, run) for s, spec in SCRIPTS.items() for run in ("ddp", "flat") if run in spec.captured]


@pytest.fixture(params=CAPTURED, ids=[f"{s[:-3]}-{run}" for s, run in CAPTURED])
def captured(request, unit_dir):
    """(ScriptSpec, run, each rank's recorded --cudagraphs run, rank 0's checkpoints of the eager and this run)."""
    script, run = request.param
    ranks = [json.loads((unit_dir / f"{script[:-3]}_captured_{run}_rank{r}.json").read_text()) for r in (0, 1)]
    eager = [json.loads((unit_dir / f"{script[:-3]}_captured_eager_rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks + eager:
        assert r["error"] is None, r["error"]
    runs = unit_dir / f"runs-{script[:-3]}-captured-"
    ckpts = [torch.load(f"{runs}{name}/r/checkpoint.pt", weights_only=True) for name in ("eager", run)]
    return SCRIPTS[script], run, ranks, ckpts


def test_captured_functions_hold_no_collective_nor_host_read(captured):
    """What --cudagraphs captures at world size 2: the expected functions (under DDP not the backward, whose hooks
    all-reduce), each replayed; no collective, host read, tensor made anew between calls or other path in any, the
    gradients and optimizer state they use made before the capture and kept."""
    spec, run, ranks, _ = captured
    for r in ranks:
        assert sorted(r["functions"]) == sorted(spec.captured[run]), r["functions"]
        for name, entry in r["functions"].items():
            assert entry["replays"] >= 1, (name, entry)
            assert not {k: v for k, v in entry.items() if isinstance(v, list) and v}, (name, entry)


def test_captured_runs_equal_eager_at_2_ranks(captured):
    """The --cudagraphs run's final checkpoint (parameters, optimizer state, every rank's RNG streams) is bitwise the
    eager run's, at the default learning rate."""
    _, _, _, (eager, run) = captured
    assert run["global_step"] == eager["global_step"] > 0
    assert differences(eager, run) == []


# 8. Odd world sizes (the 3-rank runs above) and two nodes
@pytest.mark.parametrize(**per_script(lambda spec: spec.two_nodes))
def test_two_nodes(tmp_path_factory, script):
    run = get_run(tmp_path_factory, "two_nodes", script).assert_finished()
    for node_rank, r in enumerate(run.ranks):
        assert (
            r["dist_rank"] == node_rank and r["env"]["LOCAL_RANK"] == "0" and r["env"]["GROUP_RANK"] == str(node_rank)
        )
    assert len(list(run.run_dir.glob("events.out.tfevents.*"))) == 1
    assert run.ranks[0]["summary_writers"] == [str(run.run_dir)] and run.ranks[1]["summary_writers"] == []
    assert str(run.run_dir / "checkpoint.pt") in run.ranks[0]["files_written"]
    assert [f for f in run.ranks[1]["files_written"] if f.startswith(str(run.runs_dir))] == []  # rank 1 wrote nothing
    assert_all_equal([r["final_params"] for r in run.ranks], "final parameters")


# 9. Reproducible. The scripts whose resume is bitwise (RESUMED_BITWISE: their envs are saved as data) prove it in
# tests/test_fault_tolerance.py's SIGTERM test: a 2-rank run without the stop and the same command stopped and resumed
# end bitwise equal, which a sampling seed of their own (a time-dependent one, say) would break.


@pytest.mark.parametrize(**per_script(lambda spec: spec.script not in RESUMED_BITWISE))
def test_reproducible(tmp_path_factory, script):
    """The 2-rank `ddp` run's command again, in other processes (the two-node launch's) with nothing recorded:
    bitwise the same checkpoint."""
    first, again = (get_run(tmp_path_factory, kind, script, "ddp", 2).assert_finished() for kind in ("whole", "again"))
    first, again = (torch.load(r.run_dir / "checkpoint.pt", weights_only=True) for r in (first, again))
    assert again["global_step"] == first["global_step"] > 0
    # PPO: agent; DQN: q_network, target_network; SAC: actor, critics, targets, log_alpha and three optimizers;
    # TD3: actor, critics, their targets and two optimizers
    states = ("agent", "q_network", "target_network", "optimizer", "actor", "qf", "qf_target", "log_alpha")
    states += ("target_actor",)
    states += ("actor_optimizer", "q_optimizer", "a_optimizer")
    for key in [k for k in states if k in first]:
        if torch.is_tensor(first[key]):
            assert torch.equal(again[key], first[key]), key
        else:
            assert_state_dicts_equal(again[key], first[key], key)
