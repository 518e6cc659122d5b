"""What policy decided for one step submission (PROTOCOL.md §5.1 step 7).

Evaluating a bundle produces a `Verdict`; the submission rule turns it into a
step record and a decision. With no policy, everything is allowed (`ALLOW`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

__all__ = ["ALLOW", "Action", "Verdict"]

#: The default approval timeout (PROTOCOL.md §7: 15 minutes).
DEFAULT_APPROVAL_TIMEOUT_S: Final = 900.0


class Action(enum.Enum):
    ALLOW = "allow"
    DENY = "deny"
    REQUIRE_APPROVAL = "require_approval"


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """The policy verdict for a step.

    Attributes:
        action: allow, deny or hold for approval.
        rule_id: the matched rule (`"default"` when the bundle's default applied,
            `""` when there is no bundle).
        reason: why, for a denial (defaults to `policy_denied` on the wire).
        approvers: who may decide an approval (empty: anyone).
        approval_timeout_s: how long an approval waits before it expires.
        approval_message: shown to the approver.
        rate_limited: non-empty when a rate limit refuses the call: the reason
            (`rate_limit_exceeded` or `rate_limiter_unavailable`).
    """

    action: Action = Action.ALLOW
    rule_id: str = ""
    reason: str = ""
    approvers: tuple[str, ...] = ()
    approval_timeout_s: float = DEFAULT_APPROVAL_TIMEOUT_S
    approval_message: str = ""
    rate_limited: str = ""


ALLOW: Final = Verdict()
