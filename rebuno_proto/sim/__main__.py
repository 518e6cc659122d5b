"""`python -m rebuno_proto.sim`: run simulation seeds, or trace one.

    python -m rebuno_proto.sim --seeds 1000 [--start 0]
    python -m rebuno_proto.sim --seed 42 --trace
    python -m rebuno_proto.sim --seed 42 --shrink

Exits 1 if any seed breaks an invariant (after printing the first failing
seed, its shrunk plan and trace), 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence

from . import INVARIANTS, PROFILES, run_seed, shrink
from ._plan import SimConfig, draw_plan, draw_workload
from ._world import RunResult


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rebuno_proto.sim",
        description="Deterministic simulation of the Rebuno protocol with faults.",
    )
    parser.add_argument("--seeds", type=int, metavar="N", help="run N seeds")
    parser.add_argument("--start", type=int, default=0, metavar="S", help="first seed (default 0)")
    parser.add_argument("--seed", type=int, metavar="S", help="run one seed")
    parser.add_argument("--trace", action="store_true", help="print the run's trace (with --seed)")
    parser.add_argument(
        "--shrink", action="store_true", help="shrink a failing seed and print it (with --seed)"
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="default",
        help="named settings: default, or harsh (6 s leases, more executions and faults)",
    )
    parser.add_argument(
        "--no-faults", action="store_true", help="run the workload without any fault"
    )
    parser.add_argument(
        "--list-invariants", action="store_true", help="print the invariants checked and exit"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    config = PROFILES[args.profile]
    if args.no_faults:
        config = dataclasses.replace(config, faults=False)
    if args.list_invariants:
        for name, text in INVARIANTS.items():
            print(f"{name}: {text}")
        print(
            f"liveness bound: {config.liveness_bound_s:.0f} simulated seconds after the last fault"
        )
        return 0
    if args.seed is not None:
        return _one(args.seed, trace=args.trace, shrinking=args.shrink, config=config)
    if args.seeds is None:
        parser.error("give --seeds N (and --start S), or --seed S")
    if args.seeds < 0 or args.start < 0:
        parser.error("--seeds and --start must not be negative")
    flag = "" if args.profile == "default" else f" --profile {args.profile}"
    if args.no_faults:
        flag += " --no-faults"
    return _many(args.start, args.seeds, config=config, flag=flag)


def _one(seed: int, *, trace: bool, shrinking: bool, config: SimConfig) -> int:
    result = run_seed(seed, config=config, trace=trace)
    if trace:
        print(f"seed {seed}")
        for fault in draw_plan(seed, config).faults:
            print(f"  fault: {fault.describe()}")
        for job in draw_workload(seed, config).jobs:
            print(f"  job: {job.key} on {job.agent_id} at {job.at:.3f}: {job.program}")
        for line in result.trace:
            print(line)
    print(_summary(result))
    for violation in result.violations:
        print(f"VIOLATION {violation}")
    if result.violations and shrinking:
        _print_shrunk(seed, config)
    return 0 if result.ok else 1


def _summary(result: RunResult) -> str:
    statuses = ", ".join(f"{k} {v}" for k, v in result.statuses.items()) or "none"
    return (
        f"seed {result.seed}: {'ok' if result.ok else 'FAILED'}; {result.events} events, "
        f"{result.sim_seconds:.1f} simulated s; executions: {statuses}; "
        f"{result.body_runs} bodies run, {result.orphan_reruns} orphan re-runs"
    )


def _print_shrunk(seed: int, config: SimConfig) -> None:
    shrunk = shrink(seed, config=config)
    if shrunk is None:
        return
    for line in shrunk.describe():
        print(line)
    print("trace of the shrunk run:")
    for line in shrunk.result.trace:
        print(line)


def _many(start: int, count: int, *, config: SimConfig, flag: str = "") -> int:
    began = time.perf_counter()
    failed: list[int] = []
    bodies = orphans = excused = 0
    slowest = 0.0
    for seed in range(start, start + count):
        result = run_seed(seed, config=config)
        bodies += result.body_runs
        orphans += result.orphan_reruns
        excused += result.excused
        slowest = max(slowest, result.settled_after if result.ok else 0.0)
        if not result.ok:
            failed.append(seed)
            if len(failed) == 1:
                print(_summary(result))
                for violation in result.violations:
                    print(f"VIOLATION {violation}")
    elapsed = time.perf_counter() - began
    rate = count / elapsed if elapsed > 0 else float("inf")
    print(
        f"ran {count} seeds ({start}..{start + count - 1}) in {elapsed:.1f}s: "
        f"{rate:.0f} seeds/s; {bodies} bodies run, {orphans} orphan re-runs, "
        f"{excused} late starts after a forward clock step; "
        f"slowest to settle: {slowest:.1f}s after the last fault "
        f"(bound {config.liveness_bound_s:.0f}s)"
    )
    if not failed:
        print("no invariant broken")
        return 0
    print(f"{len(failed)} seeds failed; first failing seed: {failed[0]}")
    print(f"reproduce: python -m rebuno_proto.sim --seed {failed[0]} --trace{flag}")
    _print_shrunk(failed[0], config)
    return 1


if __name__ == "__main__":
    sys.exit(main())
