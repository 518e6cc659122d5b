"""The harness's policy: denials and approval holds asked for by the test, laid
over the agent's own bundle (which decides everything they do not name)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rebuno_proto import Action, Agent, Execution, RateBucket, StepSubmission, Verdict, glob_match

from ..policy import PolicyHook, policy_hook

__all__ = ["DENY_RULE", "HOLD_RULE", "HarnessPolicy"]

#: The rule ids the harness's verdicts carry (in step events and denied steps).
DENY_RULE = "harness-deny"
HOLD_RULE = "harness-require-approval"


class HarnessPolicy:
    """A kernel policy hook: first the test's `deny` and `require_approval`
    globs (matched against the step's target), then the agent's bundle.

    Args:
        deny: target glob -> the denial's reason.
        require_approval: target globs whose steps wait for an approval.
        approval_timeout_s: how long such an approval waits before it expires.
    """

    def __init__(
        self,
        *,
        deny: Mapping[str, str],
        require_approval: set[str],
        approval_timeout_s: float,
    ) -> None:
        self.deny = dict(deny)
        self.require_approval = set(require_approval)
        self.approval_timeout_s = approval_timeout_s
        self._bundles: PolicyHook = policy_hook(dev_mode=True)

    def __call__(
        self,
        records: Any,  # the kernel's read view; passed through to the bundle hook
        execution: Execution,
        agent: Agent | None,
        submission: StepSubmission,
        now: float,
    ) -> tuple[Verdict, tuple[RateBucket, ...]]:
        target = submission.target
        for pattern, reason in self.deny.items():
            if glob_match(pattern, target):
                return Verdict(action=Action.DENY, rule_id=DENY_RULE, reason=reason), ()
        if any(glob_match(pattern, target) for pattern in self.require_approval):
            held = Verdict(
                action=Action.REQUIRE_APPROVAL,
                rule_id=HOLD_RULE,
                approval_timeout_s=self.approval_timeout_s,
                approval_message=f"{target}: held for approval by the test harness",
            )
            return held, ()
        return self._bundles(records, execution, agent, submission, now)
