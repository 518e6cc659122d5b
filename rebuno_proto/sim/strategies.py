"""Hypothesis strategies for fault plans (needs `hypothesis`, installed with
the `test` dependency group; the rest of `rebuno_proto` stays standard-library
only).

    from hypothesis import given, strategies as st
    from rebuno_proto.sim import run
    from rebuno_proto.sim.strategies import fault_plans

    @given(seed=st.integers(0, 2**32 - 1), plan=fault_plans())
    def test_protocol_survives(seed, plan):
        result = run(seed, plan=plan)
        assert result.ok, result.violations

Hypothesis shrinks a failing plan itself: fewer faults, earlier, shorter.
"""

from __future__ import annotations

from hypothesis import strategies as st

from ._plan import AGENTS, Fault, FaultKind, FaultPlan, MessageClass, SimConfig

__all__ = ["fault_plans", "faults"]

_DEFAULT = SimConfig()


def faults(config: SimConfig = _DEFAULT) -> st.SearchStrategy[Fault]:
    """One fault of any kind, inside the config's fault window."""
    seconds = st.floats(0.0, config.fault_window_s, allow_nan=False).map(lambda x: round(x, 3))
    return st.builds(
        Fault,
        kind=st.sampled_from(FaultKind),
        at=seconds,
        duration=st.floats(0.0, 70.0, allow_nan=False).map(lambda x: round(x, 3)),
        agent=st.sampled_from(AGENTS),
        rate=st.floats(0.0, 1.0, allow_nan=False).map(lambda x: round(x, 2)),
        delta=st.floats(-config.max_clock_jump_s, config.max_clock_jump_s, allow_nan=False).map(
            lambda x: round(x, 3)
        ),
        messages=st.sampled_from(MessageClass),
        replica=st.integers(0, max(config.replicas, 1) - 1),
    )


def fault_plans(
    config: SimConfig = _DEFAULT, *, max_faults: int | None = None
) -> st.SearchStrategy[FaultPlan]:
    """A fault plan of up to `max_faults` faults (default: the config's)."""
    limit = config.max_faults if max_faults is None else max_faults
    return st.lists(faults(config), max_size=limit).map(lambda fs: FaultPlan(tuple(fs)))
