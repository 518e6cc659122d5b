"""Policy bundles from YAML, and the kernel's policy hook.

`compile_bundle_text` parses a bundle (YAML text, the form agents and the API
store), validates every field, compiles argument regexes with RE2 (linear-time
matching, so no bundle can stall the kernel), and returns the core's `Bundle`.
A bundle either loads whole or raises `PolicyBundleError` listing every problem,
each naming the rule and the field. Compiled bundles are cached by their text.

`policy_hook` is what the kernel calls for each new step of a running execution
(PROTOCOL.md §5.1 step 7): it evaluates the agent's bundle with the core and
applies the matched rule's rate limit, reading the bucket in the submission's
own transaction. A stored bundle that no longer loads denies (fails closed).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Final

import re2
import yaml

from rebuno_proto import (
    ALLOW,
    BUNDLE_ERROR,
    RATE_LIMIT_EXCEEDED,
    RATE_LIMITER_UNAVAILABLE,
    Action,
    Agent,
    ArgumentTest,
    Bundle,
    Condition,
    Consequence,
    Execution,
    Policy,
    RateBucket,
    RateLimit,
    RateScope,
    Records,
    Rule,
    StepKind,
    StepSubmission,
    Verdict,
    count_call,
    evaluate,
    glob_error,
    rate_key,
)

#: How the kernel asks for a verdict on a new step: (tx, execution, agent,
#: submission, now) -> (verdict, rate-limit buckets to store if the step is
#: counted). `policy_hook` builds the one that enforces agents' bundles.
#: The kernel's policy hook (`rebuno_proto.Policy`): the verdict for a new
#: step, and the rate-limit buckets to store if it is counted.
PolicyHook = Policy

__all__ = [
    "BundleCache",
    "PolicyBundleError",
    "PolicyHook",
    "bundle_cache",
    "compile_bundle",
    "compile_bundle_text",
    "parse_duration",
    "policy_hook",
]

DEFAULT_APPROVAL_TIMEOUT: Final = "15m"
_TOP_KEYS: Final = ("default_action", "rules")
_RULE_KEYS: Final = ("id", "priority", "when", "then")
_WHEN_KEYS: Final = ("target", "targets", "agent_id", "agent_ids", "step_kind", "arguments")
_TEST_KEYS: Final = ("equals", "contains", "one_of", "regex")
_THEN_KEYS: Final = ("decision", "reason", "approval_config", "rate_limit")
_APPROVAL_KEYS: Final = ("approvers", "timeout", "message")
_LIMIT_KEYS: Final = ("max_calls", "window", "per_what", "on_limiter_error")
_DECISIONS: Final = {a.value: a for a in Action}
_DEFAULTS: Final = {"allow": Action.ALLOW, "deny": Action.DENY}
_KINDS: Final = {k.value: k for k in StepKind}
_SCOPES: Final = {s.value: s for s in RateScope}
_DURATION: Final = re.compile(r"(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?")
_RE2_OPTIONS: Final = re2.Options()
_RE2_OPTIONS.log_errors = False  # errors come back in the exception; keep stderr quiet


class PolicyBundleError(ValueError):
    """A bundle that does not load. `errors` lists every problem found, each
    naming where it is (`rule 'x' (rules[0]): when.step_kind: ...`)."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = tuple(errors)
        super().__init__("; ".join(errors))


#: The longest duration a bundle may give (a year): beyond it a timeout or a
#: window means "never", which a policy should say by other means.
MAX_DURATION_S: Final = 366 * 24 * 3600


def parse_duration(text: object) -> float | None:
    """Seconds in a duration like `30s`, `5m`, `90s`, `1h30m`; `None` if it is
    not one (other units, fractions, signs, zero, more than a year, or not a
    string)."""
    if not isinstance(text, str) or not text:
        return None
    found = _DURATION.fullmatch(text)
    if found is None:
        return None
    hours, minutes, seconds = (int(part or 0) for part in found.groups())
    total = hours * 3600 + minutes * 60 + seconds
    return float(total) if 0 < total <= MAX_DURATION_S else None


# -- validation -----------------------------------------------------------------------


def _kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


class _Checker:
    """Collects problems for one place (`where`) of a bundle."""

    def __init__(self, errors: list[str], where: str) -> None:
        self.errors = errors
        self.where = where

    def fail(self, field: str, problem: str) -> None:
        self.errors.append(
            f"{self.where}: {field}: {problem}" if field else f"{self.where}: {problem}"
        )

    def mapping(self, value: object, field: str, keys: tuple[str, ...]) -> Mapping[object, object]:
        """`value` as a mapping with only `keys` (absent or null: empty)."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.fail(field, f"must be a mapping, got {_kind_of(value)}")
            return {}
        for key in value:
            if key not in keys:
                self.fail(field, f"unknown key {key!r} (expected one of: {', '.join(keys)})")
        return value

    def string(self, value: object, field: str) -> str | None:
        if isinstance(value, str):
            return value
        # YAML reads `5`, `yes`, `no`, `on` as numbers and booleans.
        hint = " (quote it)" if isinstance(value, bool | int | float) else ""
        self.fail(field, f"must be a string, got {_kind_of(value)}{hint}")
        return None

    def strings(self, value: object, field: str, *, allow_empty: bool = False) -> tuple[str, ...]:
        if value is None and allow_empty:
            return ()
        if not isinstance(value, list):
            self.fail(field, f"must be a list of strings, got {_kind_of(value)}")
            return ()
        if not value and not allow_empty:
            self.fail(field, "must not be empty")
        out: list[str] = []
        for i, item in enumerate(value):
            text = self.string(item, f"{field}[{i}]")
            if text is not None:
                out.append(text)
        return tuple(out)

    def choice(self, value: object, field: str, choices: Mapping[str, Action]) -> Action | None:
        if isinstance(value, str) and value in choices:
            return choices[value]
        self.fail(field, f"must be one of {', '.join(choices)}, got {value!r}")
        return None

    def duration(self, value: object, field: str) -> float | None:
        seconds = parse_duration(value)
        if seconds is None:
            self.fail(
                field,
                f"must be a positive duration up to a year, like 30s, 5m or 1h30m, got {value!r}",
            )
        return seconds

    def glob(self, value: object, field: str) -> str | None:
        pattern = self.string(value, field)
        if pattern is not None and (problem := glob_error(pattern)) is not None:
            self.fail(field, f"invalid glob {pattern!r}: {problem}")
        return pattern


def _regex(check: _Checker, value: object, field: str) -> Callable[[str], bool] | None:
    pattern = check.string(value, field)
    if pattern is None:
        return None
    try:
        compiled = re2.compile(pattern, options=_RE2_OPTIONS)
    except re2.error as err:
        detail = err.args[0] if err.args else err
        if isinstance(detail, bytes):
            detail = detail.decode("utf-8", "replace")
        check.fail(field, f"invalid regex {pattern!r}: {detail}")
        return None

    def search(text: str) -> bool:
        return compiled.search(text) is not None

    return search


def _argument_tests(check: _Checker, value: object) -> tuple[ArgumentTest, ...]:
    if not isinstance(value, dict):
        check.fail("when.arguments", f"must be a mapping, got {_kind_of(value)}")
        return ()
    if not value:
        check.fail("when.arguments", "must name at least one argument")
    tests: list[ArgumentTest] = []
    for key, raw in value.items():
        if not isinstance(key, str):
            check.fail("when.arguments", f"argument names must be strings, got {key!r}")
            continue
        field = f"when.arguments.{key}"
        spec = check.mapping(raw, field, _TEST_KEYS)
        if not any(k in spec for k in _TEST_KEYS):
            if isinstance(raw, dict | None):
                check.fail(field, "needs at least one of equals, contains, one_of, regex")
            continue
        equals = check.string(spec["equals"], f"{field}.equals") if "equals" in spec else None
        contains = None
        if "contains" in spec:
            contains = check.string(spec["contains"], f"{field}.contains")
        one_of = check.strings(spec["one_of"], f"{field}.one_of") if "one_of" in spec else None
        regex = _regex(check, spec["regex"], f"{field}.regex") if "regex" in spec else None
        tests.append(
            ArgumentTest(key=key, equals=equals, contains=contains, one_of=one_of, regex=regex)
        )
    return tuple(tests)


def _condition(check: _Checker, value: object) -> Condition:
    when = check.mapping(value, "when", _WHEN_KEYS)
    target = agent_id = None
    if "target" in when:
        target = check.glob(when["target"], "when.target")
        if target == "":
            check.fail("when.target", "must not be empty (leave it out to match any target)")
    targets: tuple[str, ...] = ()
    if "targets" in when:
        targets = check.strings(when["targets"], "when.targets")
        for i, pattern in enumerate(targets):
            check.glob(pattern, f"when.targets[{i}]")
    if "agent_id" in when:
        agent_id = check.string(when["agent_id"], "when.agent_id")
        if agent_id == "":
            check.fail("when.agent_id", "must not be empty (leave it out to match any agent)")
    agent_ids = check.strings(when["agent_ids"], "when.agent_ids") if "agent_ids" in when else ()
    step_kind = None
    if "step_kind" in when:
        raw = when["step_kind"]
        step_kind = _KINDS.get(raw) if isinstance(raw, str) else None
        if step_kind is None:
            check.fail("when.step_kind", f"must be one of {', '.join(_KINDS)}, got {raw!r}")
    arguments = _argument_tests(check, when["arguments"]) if "arguments" in when else ()
    return Condition(
        target=target,
        targets=targets,
        agent_id=agent_id,
        agent_ids=agent_ids,
        step_kind=step_kind,
        arguments=arguments,
    )


def _rate_limit(check: _Checker, value: object) -> RateLimit | None:
    limit = check.mapping(value, "then.rate_limit", _LIMIT_KEYS)
    if not isinstance(value, dict):
        return None
    max_calls = limit.get("max_calls")
    if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
        check.fail("then.rate_limit.max_calls", f"must be an integer >= 1, got {max_calls!r}")
    window_s = check.duration(limit.get("window"), "then.rate_limit.window")
    per = limit.get("per_what")
    per_what = _SCOPES.get(per) if isinstance(per, str) else None
    if per_what is None:
        check.fail("then.rate_limit.per_what", f"must be one of {', '.join(_SCOPES)}, got {per!r}")
    on_error = Action.DENY
    if "on_limiter_error" in limit:
        field = "then.rate_limit.on_limiter_error"
        on_error = check.choice(limit["on_limiter_error"], field, _DEFAULTS) or Action.DENY
    if not isinstance(max_calls, int) or window_s is None or per_what is None:
        return None
    return RateLimit(
        max_calls=max_calls, window_s=window_s, per_what=per_what, on_limiter_error=on_error
    )


def _consequence(check: _Checker, value: object) -> Consequence:
    if value is None:
        check.fail("then", "required")
    then = check.mapping(value, "then", _THEN_KEYS)
    decision = Action.DENY
    if "decision" in then:
        decision = check.choice(then["decision"], "then.decision", _DECISIONS) or Action.DENY
    elif isinstance(value, dict):
        check.fail("then.decision", "required")
    reason = ""
    if "reason" in then:
        reason = check.string(then["reason"], "then.reason") or ""
    approvers: tuple[str, ...] = ()
    timeout_s = parse_duration(DEFAULT_APPROVAL_TIMEOUT) or 900.0
    message = ""
    if "approval_config" in then:
        field = "then.approval_config"
        if decision is not Action.REQUIRE_APPROVAL:
            check.fail(field, "only allowed with decision: require_approval")
        config = check.mapping(then["approval_config"], field, _APPROVAL_KEYS)
        if "approvers" in config:
            approvers = check.strings(config["approvers"], f"{field}.approvers", allow_empty=True)
        if "timeout" in config:
            timeout_s = check.duration(config["timeout"], f"{field}.timeout") or timeout_s
        if "message" in config:
            message = check.string(config["message"], f"{field}.message") or ""
    limit = _rate_limit(check, then["rate_limit"]) if "rate_limit" in then else None
    return Consequence(
        decision=decision,
        reason=reason,
        approvers=approvers,
        approval_timeout_s=timeout_s,
        approval_message=message,
        rate_limit=limit,
    )


def compile_bundle(data: object) -> Bundle:
    """Validate a parsed bundle and build the core's `Bundle`.

    Args:
        data: the bundle as YAML or JSON would parse it (a mapping).

    Returns:
        The bundle, rules sorted by priority, regexes compiled with RE2.

    Raises:
        PolicyBundleError: anything wrong, every problem listed.
    """
    errors: list[str] = []
    top = _Checker(errors, "bundle")
    if not isinstance(data, dict):
        raise PolicyBundleError([f"bundle: must be a mapping, got {_kind_of(data)}"])
    top.mapping(data, "", _TOP_KEYS)
    default = Action.DENY
    if "default_action" in data:
        default = top.choice(data["default_action"], "default_action", _DEFAULTS) or default
    raw_rules = data.get("rules")
    if raw_rules is None:
        raw_rules = []
    elif not isinstance(raw_rules, list):
        top.fail("rules", f"must be a list, got {_kind_of(raw_rules)}")
        raw_rules = []
    rules: list[Rule] = []
    ids: dict[str, str] = {}
    priorities: dict[int, str] = {}
    for index, raw in enumerate(raw_rules):
        rule = _rule(errors, index, raw, ids, priorities)
        if rule is not None:
            rules.append(rule)
    if errors:
        raise PolicyBundleError(errors)
    return Bundle(default_action=default, rules=tuple(rules))


def _rule(
    errors: list[str], index: int, raw: object, ids: dict[str, str], priorities: dict[int, str]
) -> Rule | None:
    place = f"rules[{index}]"
    if not isinstance(raw, dict):
        errors.append(f"{place}: must be a mapping, got {_kind_of(raw)}")
        return None
    rule_id = raw.get("id")
    has_id = isinstance(rule_id, str) and rule_id != ""
    check = _Checker(errors, f"rule {rule_id!r} ({place})" if has_id else place)
    check.mapping(raw, "", _RULE_KEYS)
    if "id" not in raw:
        check.fail("id", "required")
    elif not isinstance(rule_id, str) or not rule_id:
        check.fail("id", f"must be a non-empty string, got {rule_id!r}")
    elif rule_id in ids:
        check.fail("id", f"duplicate id (also {ids[rule_id]})")
    else:
        ids[rule_id] = place
    priority = raw.get("priority")
    if "priority" not in raw:
        check.fail("priority", "required")
    elif isinstance(priority, bool) or not isinstance(priority, int):
        check.fail("priority", f"must be an integer, got {priority!r}")
    elif priority in priorities:
        check.fail("priority", f"duplicate priority {priority} (also {priorities[priority]})")
    else:
        priorities[priority] = check.where
    when = _condition(check, raw.get("when"))
    then = _consequence(check, raw.get("then"))
    if not has_id or not isinstance(priority, int):
        return None
    assert isinstance(rule_id, str)
    return Rule(id=rule_id, priority=priority, when=when, then=then)


# -- loading and caching ---------------------------------------------------------------


class BundleCache:
    """Compiled bundles by their YAML text, least recently used dropped first.

    Thread-safe: SQLite transactions run in worker threads.
    """

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._items: OrderedDict[str, Bundle] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> Bundle | None:
        with self._lock:
            bundle = self._items.get(text)
            if bundle is not None:
                self._items.move_to_end(text)
            return bundle

    def put(self, text: str, bundle: Bundle) -> None:
        with self._lock:
            self._items[text] = bundle
            self._items.move_to_end(text)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __contains__(self, text: object) -> bool:
        with self._lock:
            return text in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


bundle_cache: Final = BundleCache()


def compile_bundle_text(text: str) -> Bundle:
    """Load a bundle from its YAML text, from the cache when seen before.

    Args:
        text: the bundle as stored (YAML).

    Returns:
        The compiled bundle.

    Raises:
        PolicyBundleError: not YAML, not a mapping, or invalid (nothing is cached).
    """
    bundle = bundle_cache.get(text)
    if bundle is not None:
        return bundle
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise PolicyBundleError([f"bundle: not valid YAML: {err}"]) from None
    except RecursionError:
        raise PolicyBundleError(["bundle: nested too deeply"]) from None
    bundle = compile_bundle(data)
    bundle_cache.put(text, bundle)
    return bundle


# -- the kernel hook ---------------------------------------------------------------------


def policy_hook(*, dev_mode: bool) -> PolicyHook:
    """The kernel's policy hook: evaluate the agent's bundle, apply rate limits.

    An agent without a bundle may do anything, in dev and server mode alike
    (`dev_mode` is accepted for the CLI and changes nothing today).

    Args:
        dev_mode: whether the kernel runs as `rebuno dev`.

    Returns:
        A hook for `Kernel(policy=...)`.
    """

    def hook(
        records: Records,
        execution: Execution,
        agent: Agent | None,
        submission: StepSubmission,
        now: float,
    ) -> tuple[Verdict, tuple[RateBucket, ...]]:
        if agent is None or agent.policy is None:
            return ALLOW, ()
        try:
            bundle = compile_bundle_text(agent.policy)
        except PolicyBundleError:
            return BUNDLE_ERROR, ()
        match = evaluate(
            bundle,
            agent_id=execution.agent_id,
            kind=submission.kind,
            target=submission.target,
            args_json=submission.args,
        )
        rule, verdict = match.rule, match.verdict
        limit = None if rule is None else rule.then.rate_limit
        if rule is None or limit is None:
            return verdict, ()
        key = rate_key(
            rule.id, limit.per_what, execution_id=execution.id, agent_id=execution.agent_id
        )
        try:
            bucket = records.rate_bucket(key)
        except Exception:  # the limiter (the store) is unavailable
            if limit.on_limiter_error is Action.ALLOW:
                return verdict, ()
            return dataclasses.replace(verdict, rate_limited=RATE_LIMITER_UNAVAILABLE), ()
        is_counted, counted = count_call(bucket, limit, key, now)
        if not is_counted:
            return dataclasses.replace(verdict, rate_limited=RATE_LIMIT_EXCEEDED), ()
        return verdict, (counted,)

    return hook
