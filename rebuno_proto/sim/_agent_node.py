"""The simulated agent processes: each drives the agent-side rules (`Webhooks`,
`Dispatch`, `interpret`, `conclude`) for the programs carried in executions' input."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from .._agent import (
    CancelHandler,
    CompleteExecution,
    Dispatch,
    DispatchReceived,
    ExecutionFetched,
    ExecutionReported,
    FailExecution,
    FetchExecution,
    HandlerFinished,
    HeartbeatAcked,
    HeartbeatFailed,
    LeaseLost,
    Meaning,
    Phase,
    SendHeartbeat,
    StartHandler,
    Superseded,
    Tick,
    Webhooks,
    conclude,
    interpret,
    may_start_body,
)
from .._agent import Outcome as HandlerOutcome
from .._canonical import canonical_json
from .._delivery import DeliveryResult
from .._outcome import ErrorCode, Refusal, StepDecision
from .._records import Idempotency, Lease, StepKind
from .._wire import (
    ExecutionCompletion,
    ExecutionFailure,
    StepSubmission,
    WebhookPayload,
)
from ._plan import MessageClass

if TYPE_CHECKING:
    from ._world import World

__all__ = ["AgentNode"]

_KINDS: Final = {"tool": StepKind.TOOL_CALL, "par": StepKind.TOOL_CALL, "llm": StepKind.LLM_CALL}


class _Failure(Exception):
    """How a call ended other than with a value (it unwinds or fails the handler)."""

    def __init__(self, outcome: HandlerOutcome, detail: str = "") -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail


_UNWINDS: Final = (
    HandlerOutcome.BLOCKED,
    HandlerOutcome.TERMINATED,
    HandlerOutcome.LEASE_SUPERSEDED,
)


# -- the agents ------------------------------------------------------------------------


class AgentNode:
    """An agent process: handlers by execution, under one incarnation."""

    def __init__(self, world: World, agent_id: str, replica: int = 0) -> None:
        self.w = world
        self.id = agent_id
        self.replica = replica
        self.name = f"{agent_id}#{replica}"
        self.up = True
        self.incarnation = 0
        self.stalled_until = 0.0
        self.webhooks = Webhooks()
        self.handlers: dict[str, _Handler] = {}

    def later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run `fn` on this process after `delay`, unless it crashed meanwhile;
        a stall holds it until the process thaws."""
        incarnation = self.incarnation

        def fire() -> None:
            if incarnation != self.incarnation:
                return
            if self.w.now < self.stalled_until:
                self.w.at(self.stalled_until, fire)
                return
            fn()

        self.w.at(self.w.now + delay, fire)

    def crash(self, downtime: float) -> None:
        self.up = False
        self.incarnation += 1
        self.handlers.clear()
        self.webhooks = Webhooks()

        def restart() -> None:
            self.up = True
            self.w.log(f"{self.name}: restarted")

        self.w.at(self.w.now + downtime, restart)

    def stall(self, duration: float) -> None:
        self.stalled_until = max(self.stalled_until, self.w.now + duration)

    def webhook(self, payload: WebhookPayload, answered: Callable[[DeliveryResult], None]) -> None:
        """A webhook arrives (the kernel waits for the answer, or times out)."""
        if not self.up:
            self.w.at(
                self.w.now + 0.001, lambda: answered(DeliveryResult.REFUSED)
            )  # connection refused
            return

        def receive() -> None:
            decision = self.webhooks.received(payload)
            self.w.log(
                f"{self.name}: webhook {payload.execution_id[-4:]} "
                f"attempt {payload.dispatch_attempt}: {decision}"
            )
            self.w.send(MessageClass.WEBHOOKS, self, lambda: answered(DeliveryResult.ACKED))
            if decision == "ignore":
                return
            old = self.handlers.pop(payload.execution_id, None)
            if old is not None:
                old.interrupt(Superseded())
            handler = self.handlers[payload.execution_id] = _Handler(self, payload)
            handler.start()

        self.later(0.0, receive)

    def call(
        self,
        handler: _Handler,
        op: str,
        body: Any,
        reply: Callable[[object], None],
        unreachable: Callable[[], None],
    ) -> None:
        """One request to the kernel, as the SDK's client makes it: a refused
        connection is retried for a while; a request that got no answer in time
        is `KernelUnreachable` (it may have reached the kernel: never resent)."""
        first = self.w.now
        incarnation = self.incarnation
        kernel = self.w.kernel
        state = {"done": False, "attempt": 0}

        def settle(answer: object | None, sent_at: float = 0.0) -> None:
            if state["done"] or incarnation != self.incarnation or not handler.alive:
                return
            state["done"] = True
            if answer is None:
                unreachable()
            else:
                handler.asked_at = sent_at  # when the answered request left
                reply(answer)

        def attempt() -> None:
            state["attempt"] += 1
            number = state["attempt"]
            sent_at = self.w.now

            def at_kernel() -> None:
                if not kernel.up:
                    self.later(0.001, lambda: refused(number))
                    return
                answer = kernel.request(self.id, op, handler.execution_id, handler.lease, body)
                self.w.send(
                    MessageClass.REPLIES,
                    self,
                    lambda: self.later(0.0, lambda: settle(answer, sent_at)),
                )

            self.w.send(MessageClass.REQUESTS, self, at_kernel)
            self.later(self.w.config.request_timeout_s, lambda: timed_out(number))

        def refused(number: int) -> None:
            if state["done"] or number != state["attempt"]:
                return
            if self.w.now - first >= self.w.config.refused_give_up_s:
                settle(None)
            else:
                state["attempt"] += 1  # the pending timeout belongs to the refused attempt
                self.later(self.w.config.refused_retry_s, attempt)

        def timed_out(number: int) -> None:
            if number == state["attempt"]:
                settle(None)

        attempt()


def _result_of(kind: str, target: str, args: object) -> str:
    """What a body computes: a deterministic value of its call."""
    digest = hashlib.sha256(f"{kind}|{target}|{json.dumps(args, sort_keys=True)}".encode())
    return json.dumps({"value": digest.hexdigest()[:12]})


class _Handler:
    """One dispatch on an agent: the `Dispatch` machine and the program it runs."""

    def __init__(self, node: AgentNode, payload: WebhookPayload) -> None:
        self.node = node
        self.w = node.w
        self.payload = payload
        self.execution_id = payload.execution_id
        self.lease = Lease(dispatch_id=payload.dispatch_id, attempt=payload.dispatch_attempt)
        self.machine = Dispatch()
        self.alive = True
        self.running = False
        self.ops: list[list[Any]] = []
        self.ending = "complete"
        self.pc = 0
        self.results: list[object] = []
        self._tick_at: float | None = None
        self.asked_at = 0.0  # when the request behind the latest answer was sent

    def tag(self) -> str:
        return f"{self.node.name} {self.execution_id[-4:]}#{self.lease.attempt}"

    # -- the Dispatch machine ----------------------------------------------------------

    def feed(self, event: Any) -> None:
        for action in self.machine.handle(event, now=self.w.now):
            self.act(action)
        self._schedule_tick()

    def _schedule_tick(self) -> None:
        deadline = self.machine.next_deadline()
        if deadline is not None and self.alive and deadline != self._tick_at:
            self._tick_at = deadline
            self.node.later(max(deadline - self.w.now, 0.0), self.tick)

    def tick(self) -> None:
        self._tick_at = None
        if not self.alive or self.machine.state not in (Phase.RUNNING, Phase.FINISHING):
            return
        deadline = self.machine.next_deadline()
        if deadline is not None and self.w.now >= deadline:
            self.feed(Tick())
        else:  # woken before the deadline (a stall moved it): wait on
            self._schedule_tick()

    def act(self, action: object) -> None:
        if isinstance(action, FetchExecution):
            self.node.call(self, "get", None, self.fetched, self.gone)
        elif isinstance(action, StartHandler):
            self.running = True
            self.next_op()
        elif isinstance(action, SendHeartbeat):
            self.node.call(self, "heartbeat", None, self.heartbeat_reply, self.heartbeat_lost)
        elif isinstance(action, CancelHandler):
            self.alive = False
            self.w.log(f"{self.tag()}: handler cancelled")
        elif isinstance(action, (CompleteExecution, FailExecution)):
            ending: Any = (
                ExecutionCompletion(output=action.output, state=action.state)
                if isinstance(action, CompleteExecution)
                else ExecutionFailure(error=action.reason)
            )
            self.w.log(f"{self.tag()}: ends the execution ({type(ending).__name__})")
            self.node.call(self, "end", ending, self.reported, self.reported_unreachable)

    def start(self) -> None:
        self.feed(DispatchReceived(payload=self.payload))

    def interrupt(self, event: LeaseLost | Superseded) -> None:
        """The lease is gone: cancel the handler, which then reports finishing."""
        if self.machine.state in (Phase.DONE, Phase.SUPERSEDED, Phase.ERROR):
            self.alive = False
            return
        was_running = self.running
        self.feed(event)
        self.alive = False
        phase: Phase = self.machine.state
        if was_running and phase is Phase.SUPERSEDED:
            self.machine.handle(HandlerFinished(conclusion=None), now=self.w.now)
        self.release()

    def release(self) -> None:
        self.alive = False
        self.node.webhooks.finished(self.execution_id, self.lease)
        if self.node.handlers.get(self.execution_id) is self:
            del self.node.handlers[self.execution_id]

    def fetched(self, answer: object) -> None:
        if answer == "missing" or not isinstance(answer, str):
            self.unexpected(f"execution fetch answered {answer!r}")
            return
        execution = self.w.records.executions.get(self.execution_id)
        program = json.loads(execution.input) if execution is not None else {}
        self.ops = program.get("ops", [])
        self.ending = program.get("end", "complete")
        self.feed(ExecutionFetched(status=answer))
        if self.machine.state is Phase.DONE:
            self.release()

    def gone(self) -> None:
        """The kernel did not answer the fetch: drop this delivery."""
        self.release()

    def heartbeat_reply(self, answer: object) -> None:
        if isinstance(answer, Refusal) and answer.code is ErrorCode.LEASE_SUPERSEDED:
            self.interrupt(LeaseLost())
        elif isinstance(answer, Refusal):
            self.feed(HeartbeatFailed())
        else:
            self.feed(HeartbeatAcked())

    def heartbeat_lost(self) -> None:
        self.feed(HeartbeatFailed())

    def reported(self, answer: object) -> None:
        if isinstance(answer, Refusal) and answer.code is ErrorCode.LEASE_SUPERSEDED:
            self.interrupt(LeaseLost())
            return
        self.feed(ExecutionReported())
        self.release()

    def reported_unreachable(self) -> None:
        self.feed(ExecutionReported())
        self.release()

    def unexpected(self, what: str) -> None:
        self.w.check.fail("unexpected_reply", f"{self.tag()}: {what}")
        self.release()

    # -- the program -------------------------------------------------------------------

    def next_op(self) -> None:
        if not self.alive:
            return
        if self.pc >= len(self.ops):
            if self.ending == "fail":
                self.finish(HandlerOutcome.OTHER_ERROR, "the program fails", "SimError")
            else:
                self.finish(HandlerOutcome.RETURNED)
            return
        op = self.ops[self.pc]
        name, target, args, idem, catch = op[0], op[1], op[2], op[3], op[4]
        copies = int(op[5]) if name == "par" else 1
        outstanding = [copies]
        failures: list[_Failure] = []
        values: list[object] = []

        def done(value: object | _Failure) -> None:
            if isinstance(value, _Failure):
                failures.append(value)
            else:
                values.append(value)
            outstanding[0] -= 1
            if outstanding[0] or not self.alive:
                return
            unwind = next((f for f in failures if f.outcome in _UNWINDS), None)
            if unwind is not None:
                self.finish(unwind.outcome, unwind.detail)
                return
            if failures and not catch:
                self.finish(failures[0].outcome, failures[0].detail)
                return
            self.results.append(sorted(map(str, values)))
            self.pc += 1
            self.next_op()

        for _ in range(copies):
            self.call(name, target, args, idem, done)

    def call(
        self, name: str, target: str, args: object, idem: str, done: Callable[[Any], None]
    ) -> None:
        """One recording primitive: submit, then run the body, replay or raise."""
        submission = StepSubmission(
            kind=_KINDS.get(name, StepKind.LOCAL),
            target=target,
            args=canonical_json(json.dumps(args).encode()).decode(),
            idempotency=Idempotency(idem),
        )

        def decided(answer: object) -> None:
            if isinstance(answer, Refusal):
                if answer.code is ErrorCode.LEASE_SUPERSEDED:
                    self.interrupt(LeaseLost())
                else:
                    self.unexpected(
                        f"submit {target} refused: {answer.code.value} {answer.message}"
                    )
                return
            assert isinstance(answer, StepDecision)
            meaning = interpret(answer.decision.value, has_error=answer.error is not None)
            if meaning is Meaning.RUN_BODY and not may_start_body(
                asked_at=self.asked_at,
                now=self.w.now,
                lease_timeout_s=self.payload.lease_timeout_seconds,
            ):
                self.w.log(f"{self.tag()}: proceed for {target} came too late; lease lost")
                self.interrupt(LeaseLost())
            elif meaning is Meaning.RUN_BODY:
                self.body(name, target, args, submission.idempotency, answer.step_id, done)
            elif meaning is Meaning.RETURN_RESULT:
                done(answer.result)
            elif meaning is Meaning.RAISE_RECORDED_ERROR:
                done(_Failure(HandlerOutcome.TOOL_ERROR, f"{target}: {answer.error}"))
            elif meaning is Meaning.RAISE_POLICY_ERROR:
                done(_Failure(HandlerOutcome.POLICY_ERROR, answer.reason))
            elif meaning is Meaning.RAISE_RATE_LIMITED:
                done(_Failure(HandlerOutcome.RATE_LIMITED, answer.reason))
            elif meaning is Meaning.RAISE_BLOCKED:
                done(_Failure(HandlerOutcome.BLOCKED))
            elif meaning is Meaning.RAISE_TERMINATED:
                done(_Failure(HandlerOutcome.TERMINATED))
            else:
                self.unexpected(f"submit {target} decided {answer.decision.value}")

        self.node.call(self, "submit", submission, decided, self.unreachable)

    def body(
        self,
        name: str,
        target: str,
        args: Any,
        idem: Idempotency,
        step_id: str,
        done: Callable[[Any], None],
    ) -> None:
        self.w.check.body_started(self.execution_id, step_id, self.lease, idem)
        self.w.log(f"{self.tag()}: runs {target} ({step_id[:8]})")
        fails = isinstance(args, dict) and bool(args.get("fail"))
        result = _result_of(name, target, args)
        error = json.dumps({"reason": "tool_error", "message": f"{target} failed"})

        def finished() -> None:
            if not self.alive:
                return  # cancelled mid-body: nothing is reported

            def recorded(answer: object) -> None:
                if isinstance(answer, Refusal):
                    if answer.code is ErrorCode.LEASE_SUPERSEDED:
                        self.interrupt(LeaseLost())
                    else:
                        self.unexpected(f"{target} result refused: {answer.message}")
                    return
                # Recorded, or `replay` because the step had already ended: the
                # SDK keeps what its own body did either way.
                if fails:
                    done(_Failure(HandlerOutcome.TOOL_ERROR, f"{target} failed"))
                else:
                    done(result)

            op = "fail" if fails else "complete"
            self.node.call(
                self, op, (step_id, error if fails else result), recorded, self.unreachable
            )

        self.node.later(self.w.timing.uniform(0.01, 4.0), finished)

    def unreachable(self) -> None:
        """A call got no answer: the SDK cancels the handler and the dispatch unwinds."""
        if not self.alive:
            return
        self.w.log(f"{self.tag()}: kernel unreachable, unwinding")
        self.finish(HandlerOutcome.LEASE_SUPERSEDED)

    def finish(self, outcome: HandlerOutcome, detail: str = "", error_class: str = "") -> None:
        if not self.alive:
            return
        self.running = False
        output = canonical_json(json.dumps({"results": self.results}).encode()).decode()
        conclusion = conclude(outcome, detail=detail, error_class=error_class, output=output)
        self.w.log(f"{self.tag()}: handler ends {outcome.value}")
        self.feed(HandlerFinished(conclusion=conclusion))
        if conclusion is None:
            self.release()
