"""`python -m benchmark.gpu_check`: its flags, the checks by kind (`CHECKS`), and `main`."""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import benchmark.gpu_check
from benchmark.gpu_check import correctness, plan, runner, speed
from benchmark.gpu_check.sizes import CPU, GPU, SAC, TD3, scripts

CHECKS = correctness.CHECKS | speed.CHECKS  # check kind -> its function (c, script) or (c)
PER_SCRIPT = ("script", "gloo", "flat", "compile", "compile-flat", "compile-speed", "sync-debug", "profile", "graphs")
PER_SCRIPT += ("graphs-speed", "leanrl")
SINGLE = ("nccl-1", "nccl-guard", "resume", "evaluate", "throughput")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmark.gpu_check",
        description=benchmark.gpu_check.__doc__.split("\n\n")[0],
        epilog=f"checks: {', '.join(PER_SCRIPT)} (each as <check>:<script>), {', '.join(SINGLE)}, env-sweep:<envs>",
    )
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument(
        "--quick", action="store_true", help=f"the quick profile (the default): within --budget ({plan.QUICK_BUDGET} s)"
    )
    profile.add_argument("--full", action="store_true", help="every check, one at a time: about 20-30 minutes")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: the checks on the CPU at tiny sizes, as the CPU test runs them (default: cuda)",
    )
    parser.add_argument(
        "--cleanrl-script",
        default=os.environ.get("CLEANRL_PPO_ATARI_MULTIGPU"),
        help="CleanRL's ppo_atari_multigpu.py to measure next to ours: benchmark/peers/cleanrl_ppo_atari_multigpu.py "
        "(ported to gymnasium 1.x) or a CleanRL checkout's (default: $CLEANRL_PPO_ATARI_MULTIGPU; else skipped)",
    )
    parser.add_argument(
        "--leanrl-script",
        help="LeanRL's PPO Atari script, benchmark/peers/leanrl_ppo_atari.py, to measure next to ours with --compile "
        "--cudagraphs (needs EnvPool: benchmark/offline_wheels.sh; skipped without it or without this flag)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help=f"seconds: a check starts only if its estimate (ESTIMATES) ends within them, else it is a skip line "
        f"(default: {plan.QUICK_BUDGET} for the quick profile on CUDA, else none; 0: none)",
    )
    for algo, script in (("sac", SAC), ("td3", TD3)):
        parser.add_argument(
            f"--leanrl-{algo}-script",
            default=os.environ.get(f"LEANRL_{algo.upper()}_SCRIPT"),
            help=f"LeanRL's {algo} script ported to today's packages "
            f"(benchmark/peers/leanrl_{algo}_continuous_action.py; needs torchrl), to measure next to {script} in the "
            f"leanrl check (--full; default: "
            f"$LEANRL_{algo.upper()}_SCRIPT; skipped when neither is set)",
        )
    parser.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks of the profile")
    parser.add_argument(
        "--out",
        type=Path,
        help="an empty or new folder for summary.txt, logs/ and runs/ (default: gpu_check/<UTC time> in the "
        "system's temporary folder)",
    )
    args = parser.parse_args(argv)
    steps = plan.full_profile() if args.full else plan.quick_profile()
    in_profile = {name for step in steps for name in step}
    for o in args.only or []:
        if o not in in_profile:
            known = f"{', '.join(PER_SCRIPT)} as <check>:<script> for one of {', '.join(scripts())}"
            known += f"; {', '.join(SINGLE)}; env-sweep:<envs>"
            where = "" if args.full or o not in {n for s in plan.full_profile() for n in s} else " (it is in --full)"
            parser.error(f"--only {o}: not a check of this profile{where}; the checks are {known}")
    if args.only:
        steps = [[name for name in step if name in args.only] for step in steps]
        steps = [step for step in steps if step]

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing checked")
        return 0
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = args.out or Path(tempfile.gettempdir()) / "gpu_check" / stamp
    if out.exists() and any(out.iterdir()):  # a run directory there would be resumed, not started
        parser.error(f"--out {out} is not empty")
    leanrl = {SAC: args.leanrl_sac_script, TD3: args.leanrl_td3_script}
    sizes = GPU if args.device == "cuda" else CPU
    c = runner.Check(args.device, sizes, out, args.cleanrl_script, args.leanrl_script, leanrl)
    quick_on_cuda = not args.full and args.device == "cuda"
    budget = args.budget if args.budget is not None else plan.QUICK_BUDGET if quick_on_cuda else 0
    header = f"gpu_check --{'full' if args.full else 'quick'} on {args.device}: {runner.machine(args.device)}; "
    header += time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return runner.run_steps(c, steps, CHECKS, budget, header)


if __name__ == "__main__":
    sys.exit(main())
