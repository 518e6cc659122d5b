"""Policy bundles as data: evaluation, target globs, argument text, rate-limit arithmetic.

A bundle is a list of rules and a default (PROTOCOL.md §5.1 step 7). `evaluate`
finds the first rule, by ascending priority, whose conditions all hold, and
turns its consequence into a `Verdict`; when none holds the bundle's default
applies, except that an unmatched `local` step is always allowed (§1.4).

Loading a bundle (YAML, validation, compiling regexes with a linear-time engine)
happens in the adapter: this module never compiles a regex. An `ArgumentTest`
receives its regex as a ready-made callable, so the core stays pure and the
cost of every match is whatever the adapter's engine guarantees.

Rate limits use fixed windows. The core only does the arithmetic (`count_call`)
and names the bucket (`rate_key`); the adapter reads the bucket inside the
submission transaction and hands the new one to `decide_submission`.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from ._canonical import Document, canonical_json, parse_document
from ._errors import CanonicalJSONError
from ._glob import glob_error, glob_match
from ._outcome import RateBucket
from ._records import StepKind
from ._verdict import DEFAULT_APPROVAL_TIMEOUT_S, Action, Verdict

__all__ = [
    "BUNDLE_ERROR",
    "DEFAULT_RULE_ID",
    "RATE_LIMITER_UNAVAILABLE",
    "RATE_LIMIT_EXCEEDED",
    "ArgumentTest",
    "Bundle",
    "Condition",
    "Consequence",
    "Match",
    "RateLimit",
    "RateScope",
    "Rule",
    "argument_text",
    "count_call",
    "evaluate",
    "glob_error",
    "glob_match",
    "rate_key",
]

#: The rule id a verdict carries when no rule matched.
DEFAULT_RULE_ID: Final = "default"
DEFAULT_DENY_REASON: Final = "no explicit allow rule matched"
RATE_LIMIT_EXCEEDED: Final = "rate_limit_exceeded"
RATE_LIMITER_UNAVAILABLE: Final = "rate_limiter_unavailable"
#: What a stored bundle that no longer loads decides: deny (fail closed).
BUNDLE_ERROR: Final = Verdict(
    action=Action.DENY, rule_id="bundle-error", reason="policy_bundle_invalid"
)


class RateScope(enum.Enum):
    """Whose calls one rate-limit bucket counts (`per_what`)."""

    EXECUTION = "execution"
    AGENT = "agent"
    GLOBAL = "global"


@dataclass(frozen=True, slots=True, kw_only=True)
class RateLimit:
    """At most `max_calls` counted calls per fixed window of `window_s` seconds.

    `on_limiter_error` is `Action.DENY` (refuse when the bucket cannot be read)
    or `Action.ALLOW` (let the call through uncounted).
    """

    max_calls: int
    window_s: float
    per_what: RateScope
    on_limiter_error: Action = Action.DENY


@dataclass(frozen=True, slots=True, kw_only=True)
class ArgumentTest:
    """Tests on the text of one top-level argument (see `argument_text`).

    The key must exist and every test given (not `None`) must pass. `regex`
    is a compiled matcher supplied by the adapter: it answers whether the
    pattern occurs anywhere in the text.
    """

    key: str
    equals: str | None = None
    contains: str | None = None
    one_of: tuple[str, ...] | None = None
    regex: Callable[[str], bool] | None = field(default=None, compare=False)

    def passes(self, text: str) -> bool:
        """Whether `text`, the argument's text, passes every test given."""
        if self.equals is not None and text != self.equals:
            return False
        if self.contains is not None and self.contains not in text:
            return False
        if self.one_of is not None and text not in self.one_of:
            return False
        return self.regex is None or self.regex(text)


@dataclass(frozen=True, slots=True, kw_only=True)
class Condition:
    """When a rule applies: every condition given holds (an empty one always does).

    `target` and each of `targets` are globs on the step target; `target` must
    match and, if `targets` is not empty, so must one of `targets`. `agent_id`
    and `agent_ids` compare exactly, in the same way.
    """

    target: str | None = None
    targets: tuple[str, ...] = ()
    agent_id: str | None = None
    agent_ids: tuple[str, ...] = ()
    step_kind: StepKind | None = None
    arguments: tuple[ArgumentTest, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Consequence:
    """What a matching rule decides (`then`)."""

    decision: Action
    reason: str = ""
    approvers: tuple[str, ...] = ()
    approval_timeout_s: float = DEFAULT_APPROVAL_TIMEOUT_S
    approval_message: str = ""
    rate_limit: RateLimit | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """One rule of a bundle. Ids and priorities are unique within a bundle."""

    id: str
    priority: int
    when: Condition
    then: Consequence


@dataclass(frozen=True, slots=True, kw_only=True)
class Bundle:
    """A validated bundle. `rules` are kept sorted by ascending priority."""

    default_action: Action = Action.DENY
    rules: tuple[Rule, ...] = ()

    def __post_init__(self) -> None:
        # Evaluation walks the rules in order and stops at the first match.
        object.__setattr__(self, "rules", tuple(sorted(self.rules, key=lambda r: r.priority)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Match:
    """The result of `evaluate`: the matched rule (`None`: no rule matched) and
    its verdict before any rate limit is applied."""

    rule: Rule | None
    verdict: Verdict


# -- evaluation -----------------------------------------------------------------------


def evaluate(
    bundle: Bundle, *, agent_id: str, kind: StepKind, target: str, args_json: str
) -> Match:
    """Decide a new step by the first matching rule (PROTOCOL.md §5.1 step 7).

    Args:
        bundle: the agent's bundle.
        agent_id: the agent the execution belongs to.
        kind: the step kind.
        target: the step target.
        args_json: the step's arguments as canonical JSON text.

    Returns:
        The matched rule and its verdict; with no match, the bundle's default
        (rule id `default`), or allow for a `local` step (§1.4).
    """
    args: _Args | None = None
    for rule in bundle.rules:
        when = rule.when
        if not _head_holds(when, agent_id, kind, target):
            continue
        if when.arguments:
            if args is None:
                args = _Args(args_json)
            if not args.pass_all(when.arguments):
                continue
        return Match(rule=rule, verdict=_rule_verdict(rule))
    if kind is StepKind.LOCAL or bundle.default_action is Action.ALLOW:
        return Match(rule=None, verdict=Verdict(action=Action.ALLOW, rule_id=DEFAULT_RULE_ID))
    return Match(
        rule=None,
        verdict=Verdict(action=Action.DENY, rule_id=DEFAULT_RULE_ID, reason=DEFAULT_DENY_REASON),
    )


def _head_holds(when: Condition, agent_id: str, kind: StepKind, target: str) -> bool:
    if when.step_kind is not None and when.step_kind is not kind:
        return False
    if when.agent_id is not None and when.agent_id != agent_id:
        return False
    if when.agent_ids and agent_id not in when.agent_ids:
        return False
    if when.target is not None and not glob_match(when.target, target):
        return False
    return not when.targets or any(glob_match(p, target) for p in when.targets)


def _rule_verdict(rule: Rule) -> Verdict:
    then = rule.then
    if then.decision is Action.DENY:
        return Verdict(action=Action.DENY, rule_id=rule.id, reason=then.reason or "policy_denied")
    if then.decision is Action.REQUIRE_APPROVAL:
        return Verdict(
            action=Action.REQUIRE_APPROVAL,
            rule_id=rule.id,
            approvers=then.approvers,
            approval_timeout_s=then.approval_timeout_s,
            approval_message=then.approval_message,
        )
    return Verdict(action=Action.ALLOW, rule_id=rule.id)


class _Args:
    """A step's arguments, parsed once per evaluation and only if a rule asks."""

    __slots__ = ("_doc", "_object", "_texts")

    def __init__(self, args_json: str) -> None:
        self._texts: dict[str, str] = {}
        self._object: dict[str, object] | None = None
        try:
            doc = parse_document(args_json.encode("utf-8", "surrogatepass"))
        except CanonicalJSONError:
            return
        self._doc: Document = doc
        # Rebuno decodes arguments into float64s: a number out of that range
        # fails the decoding, and then no argument condition holds.
        if isinstance(doc.value, dict) and _numbers_fit(doc):
            self._object = doc.value

    def pass_all(self, tests: tuple[ArgumentTest, ...]) -> bool:
        if self._object is None:
            return False
        for test in tests:
            text = self._texts.get(test.key)
            if text is None:
                if test.key not in self._object:
                    return False
                text = self._text(self._object[test.key])
                self._texts[test.key] = text
            if not test.passes(text):
                return False
        return True

    def _text(self, node: object) -> str:
        doc = self._doc
        literal = doc.number_text(node)
        if literal is not None:
            return _go_float(float(literal))
        if isinstance(node, dict | list):
            # Containers keep their canonical text: number literals as sent.
            return doc.canonical(node).decode("utf-8")
        return argument_text(doc.plain(node))


def _numbers_fit(doc: Document) -> bool:
    stack: list[object] = [doc.value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        else:
            literal = doc.number_text(node)
            if literal is not None and math.isinf(float(literal)):
                return False
    return True


def argument_text(value: object) -> str:
    """The text an argument value is compared as, the way Rebuno prints it.

    Strings are themselves; numbers print as Go's `%v` prints a float64 (`5`,
    `2.5`, `1e+06`, `1e+21`); `true`/`false`; `null` is `<nil>`; objects and
    arrays are their compact JSON text.

    Args:
        value: a parsed JSON value (`str`, `int`, `float`, `bool`, `None`,
            `list`, `dict`).

    Returns:
        The text.
    """
    if isinstance(value, str):
        return value
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        try:
            return _go_float(float(value))
        except OverflowError:
            return "+Inf" if value > 0 else "-Inf"
    # Compact JSON in canonical form (sorted keys, Go's escaping).
    return canonical_json(json.dumps(value, ensure_ascii=False).encode("utf-8")).decode("utf-8")


def _go_float(value: float) -> str:
    """Go's `%v` of a float64: shortest round-trip digits, `%e` form when the
    decimal exponent is below -4 or at least 6 (strconv's shortest `%g`)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    sign = "-" if math.copysign(1.0, value) < 0 else ""
    if value == 0:
        return sign + "0"
    mantissa, _, exp_text = repr(abs(value)).partition("e")
    whole, _, frac = mantissa.partition(".")
    raw = whole + frac
    stripped = raw.lstrip("0")
    # `point`: where the decimal point sits relative to the significant digits.
    point = len(whole) + (int(exp_text) if exp_text else 0) - (len(raw) - len(stripped))
    digits = stripped.rstrip("0")
    exponent = point - 1
    if exponent < -4 or exponent >= 6:
        head = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{sign}{head}e{'-' if exponent < 0 else '+'}{abs(exponent):02d}"
    if point <= 0:
        return f"{sign}0.{'0' * -point}{digits}"
    if point >= len(digits):
        return sign + digits + "0" * (point - len(digits))
    return f"{sign}{digits[:point]}.{digits[point:]}"


# -- rate limits ----------------------------------------------------------------------


def rate_key(rule_id: str, per_what: RateScope, *, execution_id: str, agent_id: str) -> str:
    """The bucket key for a rule's limit: `rule|scope-kind|scope`.

    Args:
        rule_id: the rule whose limit it is.
        per_what: what the limit counts per.
        execution_id: the execution the step belongs to.
        agent_id: the agent the execution belongs to.

    Returns:
        `f"{rule_id}|{per_what}|{scope}"`, scope being the execution id, the
        agent id, or `*`.
    """
    if per_what is RateScope.EXECUTION:
        scope = execution_id
    elif per_what is RateScope.AGENT:
        scope = agent_id
    else:
        scope = "*"
    return f"{rule_id}|{per_what.value}|{scope}"


def count_call(
    bucket: RateBucket | None, limit: RateLimit, key: str, now: float
) -> tuple[bool, RateBucket]:
    """Count one call against a fixed-window limit.

    Args:
        bucket: the stored bucket, `None` if there is none yet.
        limit: the rule's limit.
        key: the bucket key (`rate_key`).
        now: the current time, seconds.

    Returns:
        `(True, bucket with the call counted)` to store with the step, or
        `(False, bucket as it stands)` when the window is full: the call is
        refused and nothing is written.
    """
    if bucket is None or now >= bucket.window_start + limit.window_s:
        bucket = RateBucket(key=key, window_start=now, count=0)
    if bucket.count >= limit.max_calls:
        return False, bucket
    return True, RateBucket(key=key, window_start=bucket.window_start, count=bucket.count + 1)
