"""Policy bundles: evaluation and globs (rebuno_proto/_policy.py), loading and
validation, rate limits and the kernel hook (rebuno_anyio/policy.py)."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import re2
import yaml
from _support import AGENT_ID, DISPATCH_ID, EXEC_ID, LEASE, T0, agent, execution, submission
from hypothesis import HealthCheck, given, settings

from rebuno_anyio.kernel import Kernel
from rebuno_anyio.policy import (
    PolicyBundleError,
    bundle_cache,
    compile_bundle,
    compile_bundle_text,
    parse_duration,
    policy_hook,
)
from rebuno_anyio.store import MemoryStore, StoreError, Tx
from rebuno_proto import (
    ALLOW,
    BUNDLE_ERROR,
    DEFAULT_RULE_ID,
    Action,
    ArgumentTest,
    Bundle,
    Change,
    Condition,
    Consequence,
    Decision,
    RateBucket,
    RateLimit,
    RateScope,
    Rule,
    StepDecision,
    StepKind,
    Verdict,
    argument_text,
    count_call,
    evaluate,
    glob_error,
    glob_match,
    rate_key,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def load(text: str) -> Bundle:
    return compile_bundle_text(text)


def decide(
    bundle: Bundle | str,
    target: str = "search",
    *,
    kind: StepKind = StepKind.TOOL_CALL,
    args: object = None,
    args_json: str | None = None,
    agent_id: str = "bot",
) -> Verdict:
    if isinstance(bundle, str):
        bundle = load(bundle)
    text = args_json if args_json is not None else json.dumps({} if args is None else args)
    return evaluate(bundle, agent_id=agent_id, kind=kind, target=target, args_json=text).verdict


def one_rule(when: str, decision: str = "allow") -> str:
    """A one-rule bundle: rule `r` deciding `decision` when `when` (YAML flow style)."""
    return f"rules:\n- {{id: r, priority: 1, when: {when}, then: {{decision: {decision}}}}}\n"


# -- evaluation ----------------------------------------------------------------------------

PRIORITIES = """
default_action: deny
rules:
  - id: late-allow
    priority: 30
    when: {target: "search*"}
    then: {decision: allow}
  - id: early-deny
    priority: 5
    when: {target: "search_web"}
    then: {decision: deny, reason: "no web"}
  - id: middle-hold
    priority: 10
    when: {target: "search_*"}
    then: {decision: require_approval}
"""


@pytest.mark.parametrize(
    ("target", "action", "rule_id"),
    [
        ("search_web", Action.DENY, "early-deny"),
        ("search_docs", Action.REQUIRE_APPROVAL, "middle-hold"),
        ("search", Action.ALLOW, "late-allow"),
        ("delete", Action.DENY, DEFAULT_RULE_ID),
    ],
)
def test_first_match_by_priority_wins_whatever_the_file_order(
    target: str, action: Action, rule_id: str
) -> None:
    verdict = decide(PRIORITIES, target)
    assert (verdict.action, verdict.rule_id) == (action, rule_id)


def test_rules_are_kept_sorted_by_priority() -> None:
    assert [r.id for r in load(PRIORITIES).rules] == ["early-deny", "middle-hold", "late-allow"]


def test_default_deny_names_the_default_rule_and_a_reason() -> None:
    assert decide("rules: []", "anything") == Verdict(
        action=Action.DENY, rule_id="default", reason="no explicit allow rule matched"
    )
    assert decide("default_action: deny", "x").action is Action.DENY


def test_default_allow() -> None:
    assert decide("default_action: allow\n", "anything") == Verdict(
        action=Action.ALLOW, rule_id="default"
    )


def test_default_applies_only_when_nothing_matches() -> None:
    bundle = "default_action: allow\n" + one_rule("{target: rm}", "deny")
    assert decide(bundle, "rm").rule_id == "r"
    assert decide(bundle, "ls").rule_id == "default"


@pytest.mark.parametrize("default", ["allow", "deny"])
def test_unmatched_local_steps_are_allowed_whatever_the_default(default: str) -> None:
    bundle = f"default_action: {default}\n" + one_rule("{target: other}", "deny")
    verdict = decide(bundle, "compute", kind=StepKind.LOCAL)
    assert (verdict.action, verdict.rule_id) == (Action.ALLOW, DEFAULT_RULE_ID)
    # A rule still applies to a local step when it matches.
    assert decide(bundle, "other", kind=StepKind.LOCAL).action is Action.DENY
    assert decide(bundle, "compute", kind=StepKind.TOOL_CALL).action is Action(default)


def test_an_empty_or_absent_when_matches_everything() -> None:
    for when in ("{}", "null"):
        assert decide(one_rule(when), "x", kind=StepKind.LLM_CALL).rule_id == "r"
    no_when = "rules:\n  - id: r\n    priority: 1\n    then: {decision: allow}\n"
    assert decide(no_when, "", kind=StepKind.LOCAL).rule_id == "r"


@pytest.mark.parametrize(
    ("when", "target", "kind", "agent_id", "matches"),
    [
        ("{target: 'search*'}", "search_web", StepKind.TOOL_CALL, "bot", True),
        ("{target: 'search*'}", "web_search", StepKind.TOOL_CALL, "bot", False),
        ("{targets: [a, 'b*']}", "bee", StepKind.TOOL_CALL, "bot", True),
        ("{targets: [a, 'b*']}", "a", StepKind.TOOL_CALL, "bot", True),
        ("{targets: [a, 'b*']}", "c", StepKind.TOOL_CALL, "bot", False),
        ("{target: 'x*', targets: ['*y']}", "xy", StepKind.TOOL_CALL, "bot", True),
        ("{target: 'x*', targets: ['*y']}", "xz", StepKind.TOOL_CALL, "bot", False),
        ("{agent_id: bot}", "t", StepKind.TOOL_CALL, "bot", True),
        ("{agent_id: bot}", "t", StepKind.TOOL_CALL, "bot2", False),
        ("{agent_ids: [bot, bot2]}", "t", StepKind.TOOL_CALL, "bot2", True),
        ("{agent_ids: [bot, bot2]}", "t", StepKind.TOOL_CALL, "bot3", False),
        ("{agent_id: bot, agent_ids: [bot2]}", "t", StepKind.TOOL_CALL, "bot", False),
        ("{step_kind: llm_call}", "gpt-4o", StepKind.LLM_CALL, "bot", True),
        ("{step_kind: llm_call}", "gpt-4o", StepKind.TOOL_CALL, "bot", False),
        ("{step_kind: local}", "gpt-4o", StepKind.LOCAL, "bot", True),
        ("{step_kind: tool_call, target: s}", "s", StepKind.TOOL_CALL, "bot", True),
        ("{step_kind: tool_call, target: s}", "s", StepKind.LLM_CALL, "bot", False),
    ],
)
def test_each_condition(
    when: str, target: str, kind: StepKind, agent_id: str, matches: bool
) -> None:
    verdict = decide(one_rule(when), target, kind=kind, agent_id=agent_id)
    assert (verdict.rule_id == "r") is matches


@pytest.mark.parametrize(
    ("test", "value", "matches"),
    [
        ("{equals: ls}", "ls", True),
        ("{equals: ls}", "ls -l", False),
        ("{equals: ''}", "", True),
        ("{contains: rm}", "sudo rm -rf", True),
        ("{contains: rm}", "ls", False),
        ("{one_of: [ls, pwd]}", "pwd", True),
        ("{one_of: [ls, pwd]}", "cd", False),
        ("{regex: '^ls( -l)?$'}", "ls -l", True),
        ("{regex: '^ls( -l)?$'}", "ls -la", False),
        ("{regex: 'l'}", "ls", True),  # unanchored: a search, as in Go
        ("{equals: ls, contains: s}", "ls", True),
        ("{equals: ls, contains: x}", "ls", False),
        ("{equals: '5'}", 5, True),
        ("{regex: '^[0-9]+$'}", 42, True),
        ("{equals: 'true'}", True, True),
        ("{equals: '<nil>'}", None, True),
        ("{equals: '[1,\"a\"]'}", [1, "a"], True),
        ("{contains: '\"k\":'}", {"k": 1}, True),
    ],
)
def test_argument_predicates(test: str, value: object, matches: bool) -> None:
    bundle = one_rule(f"{{arguments: {{cmd: {test}}}}}")
    assert (decide(bundle, args={"cmd": value}).rule_id == "r") is matches


def test_every_listed_argument_must_exist_and_pass() -> None:
    bundle = one_rule("{arguments: {cmd: {equals: ls}, cwd: {contains: /tmp}}}")
    assert decide(bundle, args={"cmd": "ls", "cwd": "/tmp/x"}).rule_id == "r"
    assert decide(bundle, args={"cmd": "ls"}).rule_id == "default"
    assert decide(bundle, args={"cmd": "ls", "cwd": "/home"}).rule_id == "default"


@pytest.mark.parametrize("args_json", ["null", "[]", '"ls"', "5", '[{"cmd":"ls"}]', "", "{"])
def test_arguments_that_are_not_an_object_never_match(args_json: str) -> None:
    bundle = "default_action: allow\n" + one_rule("{arguments: {cmd: {equals: ls}}}", "deny")
    assert decide(bundle, args_json=args_json).rule_id == "default"


def test_a_number_out_of_float64_range_fails_every_argument_test() -> None:
    # Rebuno decodes arguments as float64s; such a number fails the decoding.
    bundle = one_rule("{arguments: {cmd: {equals: ls}}}")
    assert decide(bundle, args_json='{"cmd":"ls","n":1e400}').rule_id == "default"
    assert decide(bundle, args_json='{"cmd":"ls","n":[{"m":-1e999}]}').rule_id == "default"
    assert decide(bundle, args_json='{"cmd":"ls","n":1e-400}').rule_id == "r"


@pytest.mark.parametrize(
    ("literal", "text"),
    [
        ("5", "5"),
        ("5.0", "5"),
        ("2.5", "2.5"),
        ("-2.5", "-2.5"),
        ("1e21", "1e+21"),
        ("1E21", "1e+21"),
        ("1000000", "1e+06"),
        ("123456", "123456"),
        ("100000.5", "100000.5"),
        ("1234567", "1.234567e+06"),
        ("0.0001", "0.0001"),
        ("0.00001", "1e-05"),
        ("-0", "-0"),
        ("0", "0"),
        ("12345678901234567890", "1.2345678901234567e+19"),
        ("1.5e300", "1.5e+300"),
        ("0.1", "0.1"),
        ("true", "true"),
        ("false", "false"),
        ("null", "<nil>"),
        ('"x y"', "x y"),
        ('{"b":2.50,"a":[1e2]}', '{"a":[1e2],"b":2.50}'),
    ],
)
def test_argument_text_as_rebuno_prints_it(literal: str, text: str) -> None:
    bundle = one_rule(f"{{arguments: {{v: {{equals: {json.dumps(text)}}}}}}}")
    assert decide(bundle, args_json=f'{{"v":{literal}}}').rule_id == "r"
    if not literal.startswith("{"):
        # As Go decodes them: every number a float64.
        assert argument_text(json.loads(literal, parse_int=float)) == text


def test_argument_text_of_plain_values() -> None:
    assert argument_text("s") == "s"
    assert argument_text(None) == "<nil>"
    assert (argument_text(True), argument_text(False)) == ("true", "false")
    assert argument_text(7) == "7"
    assert argument_text(10**400) == "+Inf"
    assert argument_text(-(10**400)) == "-Inf"
    # Not JSON values, but Go prints them so.
    assert argument_text(float("inf")) == "+Inf"
    assert argument_text(float("-inf")) == "-Inf"
    assert argument_text(float("nan")) == "NaN"
    assert argument_text({"b": [1, None], "a": "<"}) == '{"a":"\\u003c","b":[1,null]}'


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_argument_text_of_a_number_reads_back_as_the_same_float(value: float) -> None:
    text = argument_text(value)
    assert float(text) == value
    assert "e" not in text or ("e+" in text or "e-" in text)


def test_verdicts_carry_the_rule_and_its_consequence() -> None:
    bundle = """
rules:
  - id: no-rm
    priority: 1
    when: {target: rm}
    then: {decision: deny, reason: "destructive"}
  - id: no-reason
    priority: 2
    when: {target: rmdir}
    then: {decision: deny}
  - id: hold-shell
    priority: 3
    when: {target: shell}
    then:
      decision: require_approval
      reason: ignored for approvals
      approval_config: {approvers: [alice, bob], timeout: 1h30m, message: "check it"}
  - id: hold-default
    priority: 4
    when: {target: deploy}
    then: {decision: require_approval}
  - id: ok
    priority: 5
    then: {decision: allow, reason: "fine"}
"""
    assert decide(bundle, "rm") == Verdict(
        action=Action.DENY, rule_id="no-rm", reason="destructive"
    )
    assert decide(bundle, "rmdir").reason == "policy_denied"
    assert decide(bundle, "shell") == Verdict(
        action=Action.REQUIRE_APPROVAL,
        rule_id="hold-shell",
        approvers=("alice", "bob"),
        approval_timeout_s=5400.0,
        approval_message="check it",
    )
    held = decide(bundle, "deploy")
    assert (held.approvers, held.approval_timeout_s, held.rule_id) == ((), 900.0, "hold-default")
    assert decide(bundle, "ls") == Verdict(action=Action.ALLOW, rule_id="ok")


def test_the_core_evaluates_hand_built_bundles() -> None:
    rule = Rule(
        id="only-ls",
        priority=1,
        when=Condition(
            step_kind=StepKind.TOOL_CALL,
            arguments=(ArgumentTest(key="cmd", regex=lambda text: text.startswith("ls")),),
        ),
        then=Consequence(decision=Action.ALLOW),
    )
    bundle = Bundle(rules=(rule,))
    match = evaluate(
        bundle, agent_id="a", kind=StepKind.TOOL_CALL, target="sh", args_json='{"cmd":"ls"}'
    )
    assert match.rule is rule
    assert match.verdict == Verdict(action=Action.ALLOW, rule_id="only-ls")
    miss = evaluate(
        bundle, agent_id="a", kind=StepKind.TOOL_CALL, target="sh", args_json='{"cmd":"rm"}'
    )
    assert miss.rule is None
    assert miss.verdict.rule_id == DEFAULT_RULE_ID


# -- globs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "text", "matches"),
    [
        ("*", "", True),
        ("*", "anything/at all", True),
        ("", "", True),
        ("", "a", False),
        ("abc", "abc", True),
        ("abc", "abcd", False),
        ("a*b*c", "abc", True),
        ("a*b*c", "a-b-c", True),
        ("a*b*c", "axxbyyczzc", True),
        ("a*b*c", "acb", False),
        ("a*b*c", "abcx", False),
        ("**a", "a", True),
        ("?", "a", True),
        ("?", "", False),
        ("?", "ab", False),
        ("a?c", "abc", True),
        ("a?c", "ac", False),
        ("[ab]", "a", True),
        ("[ab]", "b", True),
        ("[ab]", "c", False),
        ("[!a]", "b", True),
        ("[!a]", "a", False),
        ("[^a]", "a", False),
        ("[^a]", "z", True),
        ("[a-c]x", "bx", True),
        ("[a-c]x", "dx", False),
        ("[!a-c]", "d", True),
        ("[]]", "]", True),
        ("[!]]", "]", False),
        ("[a-]", "-", True),
        ("[z-a]", "m", False),
        ("\\*", "*", True),
        ("\\*", "a", False),
        ("\\?", "?", True),
        ("\\[a]", "[a]", True),
        ("a\\\\b", "a\\b", True),
        ("[\\]]", "]", True),
        ("[", "[", True),
        ("[ab", "[ab", True),
        ("search_*", "search_web", True),
        ("mcp_*_read", "mcp_fs_read", True),
        ("mcp_*_read", "mcp_fs_write", False),
        ("é?", "éé", True),
    ],
)
def test_glob_table(pattern: str, text: str, matches: bool) -> None:
    assert glob_match(pattern, text) is matches


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        ("a*", None),
        ("[ab]", None),
        ("\\[", None),
        ("[]]", None),
        ("[ab", "unterminated character class at offset 0"),
        ("x[", "unterminated character class at offset 1"),
        ("[]", "unterminated character class at offset 0"),
        ("a\\", "trailing backslash"),
    ],
)
def test_glob_errors(pattern: str, problem: str | None) -> None:
    assert glob_error(pattern) == problem


_GLOB_CHARS = st.sampled_from("ab*?./")


@given(st.text(_GLOB_CHARS, max_size=12), st.text(st.sampled_from("ab./"), max_size=12))
def test_glob_agrees_with_fnmatchcase_without_classes(pattern: str, text: str) -> None:
    assert glob_match(pattern, text) is fnmatch.fnmatchcase(text, pattern)


@given(
    st.lists(
        st.one_of(
            st.sampled_from(["a", "b", "*", "?", "[ab]", "[!a]", "[a-c]", "[]a]", "[!]]"]),
        ),
        max_size=8,
    ).map("".join),
    st.text(st.sampled_from("abc]"), max_size=10),
)
def test_glob_agrees_with_fnmatchcase_on_classes(pattern: str, text: str) -> None:
    assert glob_match(pattern, text) is fnmatch.fnmatchcase(text, pattern)


@pytest.mark.parametrize(
    ("pattern", "text"),
    [
        ("*a*a*a*a*a*a*b", "a" * 5000),
        ("*a" * 40 + "b", "a" * 5000),
        ("*?*?*?*?*?*?*b", "a" * 5000),
        ("*[ab]*[ab]*[ab]*c", "ab" * 3000),
    ],
)
def test_glob_matching_is_never_super_linear(pattern: str, text: str) -> None:
    started = time.perf_counter()
    assert glob_match(pattern, text) is False
    assert time.perf_counter() - started < 0.5


# -- validation -------------------------------------------------------------------------


def rules_yaml(*rules: dict[str, Any], **top: Any) -> str:
    return yaml.safe_dump({**top, "rules": list(rules)}, sort_keys=False)


def rule(rule_id: object = "r1", priority: object = 1, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": rule_id, "priority": priority}
    body.update(fields)
    body.setdefault("then", {"decision": "allow"})
    return body


def r(when: str = "{}", then: str = "allow", *, priority: str = "1", extra: str = "") -> str:
    """A one-rule bundle (rule `a`) in YAML flow style; `then` is a decision or a mapping."""
    then = then if then.startswith("{") else f"{{decision: {then}}}"
    return f"rules:\n- {{id: a, priority: {priority}, when: {when}, then: {then}{extra}}}\n"


def limit(body: str) -> str:
    return r(then=f"{{decision: allow, rate_limit: {{{body}}}}}")


def approval(body: str, decision: str = "require_approval") -> str:
    return r(then=f"{{decision: {decision}, approval_config: {{{body}}}}}")


A = "rule 'a' (rules[0]): "
OK_LIMIT = "max_calls: 1, window: 1m, per_what: agent"
DURATION = "must be a positive duration up to a year, like 30s, 5m or 1h30m"

BAD_BUNDLES: list[tuple[str, str, str]] = [
    ("not yaml", "key: [unclosed", "bundle: not valid YAML"),
    ("a list", "- a\n- b\n", "bundle: must be a mapping, got a list"),
    ("a scalar", "just text", "bundle: must be a mapping, got a string"),
    ("empty", "", "bundle: must be a mapping, got null"),
    ("unknown top key", "rules: []\ndefault: deny\n", "bundle: unknown key 'default'"),
    ("bad default", "default_action: maybe", "bundle: default_action: must be one of allow, deny"),
    ("approval default", "default_action: require_approval", "got 'require_approval'"),
    ("rules not a list", "rules: {a: 1}", "bundle: rules: must be a list, got a mapping"),
    ("rule not a mapping", "rules: [x]", "rules[0]: must be a mapping, got a string"),
    ("missing id", "rules: [{priority: 1, then: {decision: allow}}]", "rules[0]: id: required"),
    ("empty id", "rules: [{id: '', priority: 1}]", "rules[0]: id: must be a non-empty string"),
    ("numeric id", "rules: [{id: 7, priority: 1}]",
     "rules[0]: id: must be a non-empty string, got 7"),
    ("duplicate id", r() + "- {id: a, priority: 2}",
     "rule 'a' (rules[1]): id: duplicate id (also rules[0])"),
    ("missing priority", "rules: [{id: a, then: {decision: allow}}]", A + "priority: required"),
    ("string priority", r(priority="'1'"), A + "priority: must be an integer, got '1'"),
    ("float priority", r(priority="1.5"), A + "priority: must be an integer, got 1.5"),
    ("bool priority", r(priority="true"), A + "priority: must be an integer, got True"),
    ("duplicate priority", r() + "- {id: b, priority: 1}",
     "rule 'b' (rules[1]): priority: duplicate priority 1 (also rule 'a' (rules[0]))"),
    ("unknown rule key", r(extra=", extra: 1"), A + "unknown key 'extra'"),
    ("unknown when key", r(when="{tool: x}"), A + "when: unknown key 'tool'"),
    ("when not a mapping", r(when="[x]"), A + "when: must be a mapping, got a list"),
    ("bad step kind", r(when="{step_kind: tool}"),
     A + "when.step_kind: must be one of tool_call, llm_call, local, got 'tool'"),
    ("target not a string", r(when="{target: 5}"),
     A + "when.target: must be a string, got a number (quote it)"),
    ("empty target", r(when="{target: ''}"), A + "when.target: must not be empty"),
    ("bad glob", r(when="{target: 'a[b'}"),
     A + "when.target: invalid glob 'a[b': unterminated character class"),
    ("empty targets", r(when="{targets: []}"), A + "when.targets: must not be empty"),
    ("targets not a list", r(when="{targets: x}"), A + "when.targets: must be a list of strings"),
    ("bad glob in targets", r(when="{targets: [ok, 'x\\']}"),
     A + "when.targets[1]: invalid glob 'x\\\\': trailing backslash"),
    ("empty agent id", r(when="{agent_id: ''}"), A + "when.agent_id: must not be empty"),
    ("agent ids not strings", r(when="{agent_ids: [x, 3]}"),
     A + "when.agent_ids[1]: must be a string"),
    ("empty arguments", r(when="{arguments: {}}"),
     A + "when.arguments: must name at least one argument"),
    ("arguments not a mapping", r(when="{arguments: [cmd]}"),
     A + "when.arguments: must be a mapping"),
    ("empty predicate", r(when="{arguments: {cmd: {}}}"),
     A + "when.arguments.cmd: needs at least one of equals, contains, one_of, regex"),
    ("null predicate", r(when="{arguments: {cmd: null}}"),
     A + "when.arguments.cmd: needs at least one of"),
    ("predicate not a mapping", r(when="{arguments: {cmd: ls}}"),
     A + "when.arguments.cmd: must be a mapping"),
    ("unknown predicate", r(when="{arguments: {cmd: {equal: ls}}}"),
     A + "when.arguments.cmd: unknown key 'equal'"),
    ("numeric equals", r(when="{arguments: {n: {equals: 5}}}"),
     A + "when.arguments.n.equals: must be a string, got a number (quote it)"),
    ("boolean contains", r(when="{arguments: {f: {contains: yes}}}"),
     A + "when.arguments.f.contains: must be a string, got a boolean (quote it)"),
    ("empty one_of", r(when="{arguments: {c: {one_of: []}}}"),
     A + "when.arguments.c.one_of: must not be empty"),
    ("one_of not strings", r(when="{arguments: {c: {one_of: [ls, 1]}}}"),
     A + "when.arguments.c.one_of[1]: must be a string"),
    ("invalid regex", r(when="{arguments: {c: {regex: '(ls'}}}"),
     A + "when.arguments.c.regex: invalid regex '(ls': missing )"),
    ("backreference", r(when="{arguments: {c: {regex: '(a)\\1'}}}"),
     A + "when.arguments.c.regex: invalid regex"),
    ("lookahead", r(when="{arguments: {c: {regex: '(?=a)a'}}}"),
     A + "when.arguments.c.regex: invalid regex"),
    ("lookbehind", r(when="{arguments: {c: {regex: '(?<!a)b'}}}"),
     A + "when.arguments.c.regex: invalid regex"),
    ("regex not a string", r(when="{arguments: {c: {regex: 1}}}"),
     A + "when.arguments.c.regex: must be a string"),
    ("missing then", "rules: [{id: a, priority: 1}]", A + "then: required"),
    ("then not a mapping", "rules: [{id: a, priority: 1, then: allow}]",
     A + "then: must be a mapping"),
    ("missing decision", r(then="{reason: x}"), A + "then.decision: required"),
    ("bad decision", r(then="block"),
     A + "then.decision: must be one of allow, deny, require_approval, got 'block'"),
    ("unknown then key", r(then="{decision: allow, why: x}"), A + "then: unknown key 'why'"),
    ("reason not a string", r(then="{decision: deny, reason: no}"),
     A + "then.reason: must be a string, got a boolean (quote it)"),
    ("approval config on allow", approval("", "allow"),
     A + "then.approval_config: only allowed with decision: require_approval"),
    ("approval config on deny", approval("timeout: 1m", "deny"),
     A + "then.approval_config: only allowed with decision: require_approval"),
    ("unknown approval key", approval("who: []"), A + "then.approval_config: unknown key 'who'"),
    ("approvers not strings", approval("approvers: [1]"),
     A + "then.approval_config.approvers[0]: must be a string"),
    ("bad timeout", approval("timeout: 15 minutes"),
     A + f"then.approval_config.timeout: {DURATION}, got '15 minutes'"),
    ("numeric timeout", approval("timeout: 30"),
     A + f"then.approval_config.timeout: {DURATION}, got 30"),
    ("zero timeout", approval("timeout: 0m"),
     A + f"then.approval_config.timeout: {DURATION}, got '0m'"),
    ("message not a string", approval("message: [x]"),
     A + "then.approval_config.message: must be a string"),
    ("rate limit not a mapping", r(then="{decision: allow, rate_limit: 5}"),
     A + "then.rate_limit: must be a mapping"),
    ("zero max_calls", limit("max_calls: 0, window: 1m, per_what: agent"),
     A + "then.rate_limit.max_calls: must be an integer >= 1, got 0"),
    ("missing max_calls", limit("window: 1m, per_what: agent"),
     A + "then.rate_limit.max_calls: must be an integer >= 1, got None"),
    ("bool max_calls", limit("max_calls: true, window: 1m, per_what: agent"),
     A + "then.rate_limit.max_calls: must be an integer >= 1"),
    ("negative window", limit("max_calls: 1, window: -1m, per_what: agent"),
     A + f"then.rate_limit.window: {DURATION}, got '-1m'"),
    ("fractional window", limit("max_calls: 1, window: 1.5m, per_what: agent"),
     A + f"then.rate_limit.window: {DURATION}"),
    ("missing window", limit("max_calls: 1, per_what: agent"),
     A + f"then.rate_limit.window: {DURATION}, got None"),
    ("bad per_what", limit("max_calls: 1, window: 1m, per_what: user"),
     A + "then.rate_limit.per_what: must be one of execution, agent, global, got 'user'"),
    ("missing per_what", limit("max_calls: 1, window: 1m"),
     A + "then.rate_limit.per_what: must be one of execution, agent, global, got None"),
    ("bad on_limiter_error", limit(OK_LIMIT + ", on_limiter_error: retry"),
     A + "then.rate_limit.on_limiter_error: must be one of allow, deny, got 'retry'"),
    ("unknown rate limit key", limit(OK_LIMIT + ", max_wait: 1s"),
     A + "then.rate_limit: unknown key 'max_wait'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "expected"), [(t, e) for _, t, e in BAD_BUNDLES], ids=[n for n, _, _ in BAD_BUNDLES]
)
def test_invalid_bundles_are_refused_naming_rule_and_field(text: str, expected: str) -> None:
    with pytest.raises(PolicyBundleError) as caught:
        compile_bundle_text(text)
    assert isinstance(caught.value, ValueError)
    assert expected in str(caught.value)
    assert text not in bundle_cache


def test_the_valid_building_blocks_load() -> None:
    # The table above breaks one thing at a time from these.
    for text in (r(), limit(OK_LIMIT), approval("timeout: 1m"), approval("")):
        compile_bundle_text(text)


def test_every_problem_is_reported_at_once() -> None:
    text = rules_yaml(
        rule("a", 1, when={"step_kind": "x"}),
        rule("a", 1, then={"decision": "nope"}),
        {"priority": 2, "then": {"decision": "allow"}},
    )
    with pytest.raises(PolicyBundleError) as caught:
        compile_bundle_text(text)
    assert caught.value.errors == (
        "rule 'a' (rules[0]): when.step_kind: must be one of tool_call, llm_call, local, got 'x'",
        "rule 'a' (rules[1]): id: duplicate id (also rules[0])",
        "rule 'a' (rules[1]): priority: duplicate priority 1 (also rule 'a' (rules[0]))",
        "rule 'a' (rules[1]): then.decision: must be one of allow, deny, require_approval,"
        " got 'nope'",
        "rules[2]: id: required",
    )
    assert str(caught.value) == "; ".join(caught.value.errors)


def test_compile_bundle_takes_parsed_data() -> None:
    bundle = compile_bundle({"default_action": "allow", "rules": None})
    assert bundle == Bundle(default_action=Action.ALLOW, rules=())
    with pytest.raises(PolicyBundleError):
        compile_bundle(["not", "a", "mapping"])


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("90s", 90.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("1h0m5s", 3605.0),
        ("2m30s", 150.0),
        ("0s", None),
        ("0h0m", None),
        ("-5m", None),
        ("1.5h", None),
        ("5", None),
        ("5 m", None),
        ("1d", None),
        ("1m1h", None),
        ("", None),
        ("ms", None),
        ("1٣s", None),  # a non-ASCII digit
        (30, None),
        (None, None),
    ],
)
def test_durations(text: object, seconds: float | None) -> None:
    assert parse_duration(text) == seconds


def test_a_valid_bundle_is_cached_by_its_text() -> None:
    text = one_rule("{target: cached-one}")
    bundle_cache.clear()
    first = compile_bundle_text(text)
    assert text in bundle_cache
    assert len(bundle_cache) == 1
    assert compile_bundle_text(text) is first


def test_the_cache_drops_the_least_recently_used() -> None:
    bundle_cache.clear()
    size = bundle_cache.size
    texts = [one_rule(f"{{target: t{i}}}") for i in range(size + 1)]
    for text in texts[:size]:
        compile_bundle_text(text)
    compile_bundle_text(texts[0])  # touch the oldest
    compile_bundle_text(texts[size])
    assert texts[0] in bundle_cache
    assert texts[1] not in bundle_cache
    assert len(bundle_cache) == size
    bundle_cache.clear()


# -- regexes run in linear time -----------------------------------------------------------


def test_a_catastrophic_regex_is_harmless_under_re2() -> None:
    compiled = re2.compile("(a+)+$")
    started = time.perf_counter()
    assert compiled.search("a" * 100_000 + "!") is None
    assert time.perf_counter() - started < 0.5


def test_a_catastrophic_regex_in_a_bundle_evaluates_fast() -> None:
    bundle = one_rule("{arguments: {q: {regex: '^(a+)+$'}}}")
    started = time.perf_counter()
    verdict = decide(bundle, args={"q": "a" * 100_000 + "!"})
    assert time.perf_counter() - started < 1.0
    assert verdict.rule_id == "default"
    assert decide(bundle, args={"q": "a" * 1000}).rule_id == "r"


# -- hypothesis: first match, defaults, invalid bundles ------------------------------------

_TARGETS = ["a", "b", "ab", "ba", ""]
_GLOBS = ["a", "b", "*", "a*", "*a", "?", "??", "b*", "[ab]", "[!a]*"]
_DECISIONS = ["allow", "deny", "require_approval"]


@st.composite
def bundles(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(min_value=0, max_value=8))
    priorities = draw(st.lists(st.integers(-50, 50), min_size=count, max_size=count, unique=True))
    rules_: list[dict[str, Any]] = []
    for i, priority in enumerate(priorities):
        when: dict[str, Any] = {}
        if draw(st.booleans()):
            when["target"] = draw(st.sampled_from(_GLOBS))
        if draw(st.booleans()):
            when["step_kind"] = draw(st.sampled_from([k.value for k in StepKind]))
        rules_.append(
            {
                "id": f"rule-{i}",
                "priority": priority,
                "when": when,
                "then": {"decision": draw(st.sampled_from(_DECISIONS))},
            }
        )
    return {"default_action": draw(st.sampled_from(["allow", "deny"])), "rules": rules_}


def _holds(raw: dict[str, Any], target: str, kind: StepKind) -> bool:
    when = raw["when"]
    if "target" in when and not fnmatch.fnmatchcase(target, when["target"]):
        return False
    return "step_kind" not in when or when["step_kind"] == kind.value


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=200)
@given(
    bundles(),
    st.sampled_from(_TARGETS),
    st.sampled_from(list(StepKind)),
    st.randoms(use_true_random=False),
)
def test_property_the_lowest_priority_matching_rule_decides(
    data: dict[str, Any], target: str, kind: StepKind, rnd: Any
) -> None:
    rnd.shuffle(data["rules"])
    bundle = compile_bundle_text(yaml.safe_dump(data))
    verdict = decide(bundle, target, kind=kind)
    matching = [r for r in data["rules"] if _holds(r, target, kind)]
    if matching:
        winner = min(matching, key=lambda r: r["priority"])
        assert verdict.rule_id == winner["id"]
        assert verdict.action is Action(winner["then"]["decision"])
    else:
        # The default applies exactly when nothing matches.
        assert verdict.rule_id == DEFAULT_RULE_ID
        allowed = kind is StepKind.LOCAL or data["default_action"] == "allow"
        assert verdict.action is (Action.ALLOW if allowed else Action.DENY)


def _break_id(data: dict[str, Any]) -> None:
    data["rules"][0].pop("id")


def _duplicate_priority(data: dict[str, Any]) -> None:
    data["rules"].append({**data["rules"][0], "id": "copy"})


def _duplicate_id(data: dict[str, Any]) -> None:
    data["rules"].append({**data["rules"][0], "priority": 1000})


def _bad_decision(data: dict[str, Any]) -> None:
    data["rules"][0]["then"] = {"decision": "maybe"}


def _bad_regex(data: dict[str, Any]) -> None:
    data["rules"][0]["when"]["arguments"] = {"x": {"regex": "(?<=a)b"}}


def _unknown_key(data: dict[str, Any]) -> None:
    data["rules"][0]["when"]["tool"] = "x"


def _bad_window(data: dict[str, Any]) -> None:
    limit = {"max_calls": 1, "window": "1 minute", "per_what": "agent"}
    data["rules"][0]["then"]["rate_limit"] = limit


def _bad_default(data: dict[str, Any]) -> None:
    data["default_action"] = "require_approval"


_BREAKERS = [
    _break_id,
    _duplicate_priority,
    _duplicate_id,
    _bad_decision,
    _bad_regex,
    _unknown_key,
    _bad_window,
    _bad_default,
]


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(bundles(), st.sampled_from(_BREAKERS), st.integers(0, 1000))
def test_property_a_bundle_that_fails_validation_never_loads(
    data: dict[str, Any], breaker: Callable[[dict[str, Any]], None], salt: int
) -> None:
    if not data["rules"]:
        data["rules"].append(
            {"id": "only", "priority": 0, "when": {}, "then": {"decision": "allow"}}
        )
    breaker(data)
    text = yaml.safe_dump(data) + f"# {salt}\n"
    with pytest.raises(PolicyBundleError):
        compile_bundle_text(text)
    assert text not in bundle_cache
    with pytest.raises(PolicyBundleError):
        compile_bundle(yaml.safe_load(text))


# -- rate-limit arithmetic ---------------------------------------------------------------

LIMIT = RateLimit(max_calls=2, window_s=60.0, per_what=RateScope.EXECUTION)


def test_count_call_counts_then_refuses_then_rolls_over() -> None:
    first = count_call(None, LIMIT, "k", 100.0)
    assert first == (True, RateBucket(key="k", window_start=100.0, count=1))
    second = count_call(first[1], LIMIT, "k", 130.0)
    assert second == (True, RateBucket(key="k", window_start=100.0, count=2))
    # A full window refuses and hands back the bucket unchanged (nothing to write).
    assert count_call(second[1], LIMIT, "k", 159.999) == (False, second[1])
    # At window_start + window a new window starts.
    fresh = count_call(second[1], LIMIT, "k", 160.0)
    assert fresh == (True, RateBucket(key="k", window_start=160.0, count=1))


def test_rate_keys_by_scope() -> None:
    kw = {"execution_id": "e1", "agent_id": "bot"}
    assert rate_key("r", RateScope.EXECUTION, **kw) == "r|execution|e1"
    assert rate_key("r", RateScope.AGENT, **kw) == "r|agent|bot"
    assert rate_key("r", RateScope.GLOBAL, **kw) == "r|global|*"


@given(
    st.integers(1, 5),
    st.integers(1, 100),
    st.lists(st.integers(0, 50), max_size=60),
)
def test_property_no_window_counts_more_than_max_calls(
    max_calls: int, window: int, gaps: list[int]
) -> None:
    limit = RateLimit(max_calls=max_calls, window_s=float(window), per_what=RateScope.GLOBAL)
    bucket: RateBucket | None = None
    now = 0.0
    allowed_at: list[float] = []
    for gap in gaps:
        now += gap
        ok, after = count_call(bucket, limit, "k", now)
        if ok:
            bucket = after
            allowed_at.append(now)
        else:
            assert after.count == max_calls
    # Reference model: calls counted in each fixed window never exceed the cap,
    # and a call is refused only when its window is full.
    starts: dict[float, int] = {}
    bucket = None
    now = 0.0
    for gap in gaps:
        now += gap
        if bucket is None or now >= bucket.window_start + window:
            bucket = RateBucket(key="k", window_start=now, count=0)
        if bucket.count < max_calls:
            bucket = dataclasses.replace(bucket, count=bucket.count + 1)
            starts[bucket.window_start] = bucket.count
    assert all(count <= max_calls for count in starts.values())
    assert len(allowed_at) == sum(starts.values())


# -- the kernel hook ---------------------------------------------------------------------

LIMITED = """
default_action: deny
rules:
  - id: search-limit
    priority: 1
    when: {target: search}
    then:
      decision: allow
      rate_limit: {max_calls: 2, window: 1m, per_what: %s}
  - id: fetch-open
    priority: 2
    when: {target: fetch}
    then:
      decision: allow
      rate_limit: {max_calls: 1, window: 1m, per_what: global, on_limiter_error: allow}
  - id: fetch-closed
    priority: 3
    when: {target: fetch_closed}
    then:
      decision: allow
      rate_limit: {max_calls: 1, window: 1m, per_what: global}
"""


class BrokenLimiter:
    """A transaction whose rate-limit reads fail, as an unreachable limiter would."""

    def __init__(self, tx: Tx) -> None:
        self._tx = tx

    def rate_bucket(self, key: str) -> RateBucket | None:
        raise StoreError("limiter down")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tx, name)


async def run_hook(
    store: MemoryStore,
    policy: str | None,
    *,
    target: str = "search",
    kind: str = "tool_call",
    args: Any = None,
    now: float = T0,
    exec_id: str = EXEC_ID,
    agent_id: str = AGENT_ID,
    broken: bool = False,
    has_agent: bool = True,
    dev_mode: bool = False,
) -> tuple[Verdict, tuple[RateBucket, ...]]:
    hook = policy_hook(dev_mode=dev_mode)
    ex = execution(exec_id=exec_id, agent_id=agent_id)
    owner = dataclasses.replace(agent(agent_id), policy=policy) if has_agent else None
    sub = submission(kind=kind, target=target, args=args)

    def run(tx: Tx) -> tuple[Verdict, tuple[RateBucket, ...]]:
        result = hook(BrokenLimiter(tx) if broken else tx, ex, owner, sub, now)
        tx.apply(Change(rate_buckets=result[1]))  # what decide_submission would store
        return result

    return await store.run(run)


@pytest.mark.parametrize("dev_mode", [True, False])
async def test_no_bundle_allows_everything(dev_mode: bool) -> None:
    store = MemoryStore()
    assert await run_hook(store, None, dev_mode=dev_mode) == (ALLOW, ())
    assert await run_hook(store, None, has_agent=False, dev_mode=dev_mode) == (ALLOW, ())


async def test_the_hook_evaluates_the_agents_bundle() -> None:
    store = MemoryStore()
    bundle = one_rule("{target: search, arguments: {q: {contains: cats}}}")
    verdict, buckets = await run_hook(store, bundle, args={"q": "about cats"})
    assert (verdict.action, verdict.rule_id, buckets) == (Action.ALLOW, "r", ())
    verdict, _ = await run_hook(store, bundle, args={"q": "dogs"})
    assert (verdict.action, verdict.rule_id) == (Action.DENY, DEFAULT_RULE_ID)


async def test_a_broken_stored_bundle_fails_closed() -> None:
    store = MemoryStore()
    text = "rules: [{id: x}]\n"
    assert await run_hook(store, text) == (BUNDLE_ERROR, ())
    assert (
        Verdict(action=Action.DENY, rule_id="bundle-error", reason="policy_bundle_invalid")
        == BUNDLE_ERROR
    )
    assert text not in bundle_cache
    assert await run_hook(store, "{{{") == (BUNDLE_ERROR, ())


async def test_rate_limit_counts_refuses_and_rolls_over() -> None:
    store = MemoryStore()
    policy = LIMITED % "execution"
    key = f"search-limit|execution|{EXEC_ID}"
    verdict, buckets = await run_hook(store, policy)
    assert verdict == Verdict(action=Action.ALLOW, rule_id="search-limit")
    assert buckets == (RateBucket(key=key, window_start=T0, count=1),)
    _, buckets = await run_hook(store, policy, now=T0 + 10)
    assert buckets == (RateBucket(key=key, window_start=T0, count=2),)
    verdict, buckets = await run_hook(store, policy, now=T0 + 59)
    assert verdict.rate_limited == "rate_limit_exceeded"
    assert (verdict.rule_id, buckets) == ("search-limit", ())
    verdict, buckets = await run_hook(store, policy, now=T0 + 60)
    assert not verdict.rate_limited
    assert buckets == (RateBucket(key=key, window_start=T0 + 60, count=1),)


OTHER_EXEC = "0192f1a0-0000-7000-8000-0000000000ee"


@pytest.mark.parametrize(
    ("scope", "same_agent_other_execution", "other_agent"),
    [("execution", False, False), ("agent", True, False), ("global", True, True)],
)
async def test_rate_limit_scopes(
    scope: str, same_agent_other_execution: bool, other_agent: bool
) -> None:
    store = MemoryStore()
    policy = LIMITED % scope
    for _ in range(2):
        assert not (await run_hook(store, policy))[0].rate_limited
    assert (await run_hook(store, policy))[0].rate_limited == "rate_limit_exceeded"
    shared = (await run_hook(store, policy, exec_id=OTHER_EXEC))[0].rate_limited != ""
    assert shared is same_agent_other_execution
    shared = (await run_hook(store, policy, exec_id=OTHER_EXEC + "1", agent_id="bot-2"))[
        0
    ].rate_limited != ""
    assert shared is other_agent


async def test_limiter_errors_deny_by_default() -> None:
    store = MemoryStore()
    verdict, buckets = await run_hook(store, LIMITED % "agent", target="fetch_closed", broken=True)
    assert verdict.rate_limited == "rate_limiter_unavailable"
    assert (verdict.rule_id, buckets) == ("fetch-closed", ())


async def test_limiter_errors_may_let_calls_through_uncounted() -> None:
    store = MemoryStore()
    verdict, buckets = await run_hook(store, LIMITED % "agent", target="fetch", broken=True)
    assert verdict == Verdict(action=Action.ALLOW, rule_id="fetch-open")
    assert buckets == ()


async def test_the_kernel_records_policy_decisions_and_rate_limits() -> None:
    store = MemoryStore()
    policy = LIMITED % "execution"
    owner = dataclasses.replace(agent(), policy=policy)
    ex = execution(last_event_seq=0)  # a store holding no events yet

    def seed(tx: Tx) -> None:
        tx.put_agent(owner)
        tx.apply(Change(executions=(ex,), new_dispatches=((DISPATCH_ID, EXEC_ID),)))

    await store.run(seed)
    kernel = Kernel(store, policy=policy_hook(dev_mode=False), clock=lambda: T0)

    async def submit(target: str, q: str) -> StepDecision:
        result = await kernel.submit(
            EXEC_ID, AGENT_ID, LEASE, submission(target=target, args={"q": q})
        )
        assert isinstance(result, StepDecision)
        return result

    assert (await submit("search", "1")).decision is Decision.PROCEED
    assert (await submit("search", "2")).decision is Decision.PROCEED
    limited = await submit("search", "3")
    assert (limited.decision, limited.reason) == (Decision.RATE_LIMITED, "rate_limit_exceeded")
    denied = await submit("delete", "x")
    assert (denied.decision, denied.rule_id) == (Decision.DENIED, DEFAULT_RULE_ID)
    assert denied.reason == "no explicit allow rule matched"
    bucket = await store.run(lambda tx: tx.rate_bucket(f"search-limit|execution|{EXEC_ID}"))
    assert bucket == RateBucket(key=f"search-limit|execution|{EXEC_ID}", window_start=T0, count=2)


# -- the examples in docs/policy.md ------------------------------------------------------------


def doc_example_texts() -> list[str]:
    """The YAML blocks of the "Examples" section, in order."""
    text = (Path(__file__).parent.parent / "docs" / "policy.md").read_text("utf-8")
    section = text.split("## Examples", 1)[1].split("\n## ", 1)[0]
    return [part.split("```", 1)[0] for part in section.split("```yaml\n")[1:]]


def doc_examples() -> list[Bundle]:
    return [compile_bundle_text(text) for text in doc_example_texts()]


def test_doc_example_allow_list() -> None:
    tools = doc_examples()[0]
    assert decide(tools, "fs_read_file").rule_id == "read-only-tools"
    assert decide(tools, "fs_write_file").reason == "no explicit allow rule matched"
    assert decide(tools, "gpt-4o-mini", kind=StepKind.LLM_CALL).action is Action.ALLOW
    assert decide(tools, "claude", kind=StepKind.LLM_CALL).action is Action.DENY
    assert decide(tools, "anything", kind=StepKind.LOCAL).action is Action.ALLOW


@pytest.mark.parametrize(
    ("target", "cmd", "rule_id"),
    [
        ("shell", "ls", "safe-listing"),
        ("shell", "ls -la /tmp", "safe-listing"),
        ("shell", "cat notes.txt", "safe-listing"),
        ("shell", "ls; rm -rf /", "other-shell"),
        ("shell", "ls && curl x | sh", "other-shell"),
        ("shell", "ls\nrm -rf /", "other-shell"),
        ("shell", "cat $(echo /etc/passwd)", "other-shell"),
        ("shell", "lsblk", "other-shell"),
        ("shell", "git status", "git-status"),
        ("shell", "git push --force", "other-shell"),
        ("shell", "sudo ls", "no-sudo"),
        ("shell", "ls; sudo rm x", "no-sudo"),
        ("shell", "echo sudoku", "other-shell"),
        ("search_web", "", "other-tools"),
    ],
)
def test_doc_example_safe_shell(target: str, cmd: str, rule_id: str) -> None:
    shell = doc_examples()[1]
    assert decide(shell, target, args={"cmd": cmd}).rule_id == rule_id
    held = decide(shell, "shell", args={"cmd": "make"})
    assert held.action is Action.REQUIRE_APPROVAL
    assert (held.approvers, held.approval_timeout_s) == (("alice", "bob"), 1800.0)


async def test_doc_example_rate_limit() -> None:
    limits = doc_examples()[2]
    assert decide(limits, "search_web", args={"mode": "deep"}).rule_id == "deep-search"
    assert decide(limits, "search_web", args={"q": "x"}).rule_id == "search"
    store = MemoryStore()
    policy = doc_example_texts()[2]
    for _ in range(3):
        verdict, _ = await run_hook(store, policy, target="search_web", args={"mode": "deep"})
        assert not verdict.rate_limited
    verdict, _ = await run_hook(store, policy, target="search_web", args={"mode": "deep"})
    assert verdict.rate_limited == "rate_limit_exceeded"
    verdict, _ = await run_hook(store, policy, target="search_web", args={"q": "x"})
    assert not verdict.rate_limited


def test_doc_format_reference_loads() -> None:
    text = (Path(__file__).parent.parent / "docs" / "policy.md").read_text("utf-8")
    reference = text.split("## The format", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    (rule_,) = compile_bundle_text(reference).rules
    assert rule_.then.rate_limit == RateLimit(
        max_calls=5, window_s=60.0, per_what=RateScope.EXECUTION, on_limiter_error=Action.DENY
    )
    assert rule_.then.approval_timeout_s == 1800.0


def test_durations_beyond_a_year_are_refused() -> None:
    assert parse_duration("8784h") == 366 * 24 * 3600
    assert parse_duration("8785h") is None
    assert parse_duration("99999999999999999999h") is None
