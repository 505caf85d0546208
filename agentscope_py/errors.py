"""Every exception agentscope-py raises on purpose, in one tree (like httpx's ``_exceptions``).

```
AgentScopeError
├── ModelError                       a model call failed (``retryable``, ``retry_after``)
│   ├── AuthenticationError          bad or missing key (401/403)
│   ├── RateLimitError               429; waiting may help (``retry_after``)
│   ├── BadRequestError              the request was refused (4xx)
│   │   └── ContextLengthError       … because it is too long for the model
│   ├── ServerError                  5xx
│   │   └── OverloadedError          529 / "overloaded"
│   ├── ModelTimeoutError            also a builtin TimeoutError
│   ├── ModelConnectionError         also a builtin ConnectionError
│   ├── MalformedStreamError         the stream broke its protocol
│   └── HedgeError                   both attempts of a hedged model call failed
├── StateStoreError                  a session store failed
│   └── StateConflictError           another writer saved first
├── ToolArgumentError                a tool got arguments its schema refuses (also a ValueError)
├── ToolInDoubtError                 a resumed call in doubt could not be decided (happened or not?)
├── ResumeError                      a resume input does not fit the pending tool calls (ValueError)
│   └── PendingToolCallsError        the session has tool calls waiting for an answer
├── StructuredOutputError            no valid structured output within the retries (ValueError)
├── CassetteMismatchError            a replayed run's request differs from the recording (AssertionError)
├── MiddlewareError                  a middleware broke the hook contract (also a TypeError)
├── MiddlewareOrderError             the middleware cannot be put in order (also a ValueError)
├── MiddlewareTermination            a middleware ended the run on purpose (guardrails…)
│   ├── GuardrailTripped             … because a guardrail tripped
│   ├── RateLimitExceeded            … because a rate limit said no
│   ├── CallLimitExceeded            … because a model or tool call limit was reached
│   ├── RunTimeoutError              … because the run took too long (also a TimeoutError)
│   └── BudgetExceeded               … because a token or cost budget was used up
├── InputError                       what the caller passed cannot be a run's input (ValueError)
├── BusyError                        the session is busy and the input's multitask strategy refuses to wait
│   └── DurableSessionBusy           … a durable run's session (``DurableAgent.start``)
├── SubAgentError                    a sub-agent cannot run where it was put
│   ├── SubAgentCycleError           … because it is reachable from itself (also a ValueError)
│   └── SubAgentDepthError           … because the tree is deeper than its limit
└── AgentInterrupted                 a run stopped by ``agent.interrupt(...)``
```

Where an exception is also a builtin kind (a timeout is a `TimeoutError`, bad arguments are a
`ValueError`), it subclasses that builtin too, so ``except TimeoutError`` catches a model timeout.
``TimeoutError`` and ``ConnectionError`` from `agentscope_py.model` are deprecated aliases of
`ModelTimeoutError` and `ModelConnectionError` (they shadow builtins): they import with a
`DeprecationWarning`.
"""

from __future__ import annotations

__all__ = [
    "AgentInterrupted",
    "AgentScopeError",
    "AuthenticationError",
    "BadRequestError",
    "BudgetExceeded",
    "BusyError",
    "CallLimitExceeded",
    "CassetteMismatchError",
    "ContextLengthError",
    "DatasetError",
    "DurableActivityError",
    "DurableSessionBusy",
    "GuardrailTripped",
    "HedgeError",
    "InputError",
    "MCPClientError",
    "MCPConnectionError",
    "MCPServerRestarted",
    "MCPTimeoutError",
    "MCPToolError",
    "MalformedStreamError",
    "MiddlewareError",
    "MiddlewareOrderError",
    "MiddlewareTermination",
    "ModelConnectionError",
    "ModelError",
    "ModelTimeoutError",
    "OverloadedError",
    "PendingToolCallsError",
    "RateLimitError",
    "RateLimitExceeded",
    "ResumeError",
    "RunLogError",
    "RunTimeoutError",
    "ScheduleStoreError",
    "ServerError",
    "StateConflictError",
    "StateStoreError",
    "StructuredOutputError",
    "SubAgentCycleError",
    "SubAgentDepthError",
    "SubAgentError",
    "SubAgentPaused",
    "ToolArgumentError",
    "ToolConflictError",
    "ToolInDoubtError",
    "ToolInputRequired",
]


class AgentScopeError(Exception):
    """The base of every error agentscope-py raises on purpose."""


# -- models --------------------------------------------------------------------------------------


class ModelError(AgentScopeError):
    """A model call failed. ``retryable`` says whether trying again may help; ``retry_after`` is
    the provider's hint in seconds."""

    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        provider: str | None = None,
        status_code: int | None = None,
        retry_after: float | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.provider = provider
        self.status_code = status_code
        self.retry_after = retry_after
        if retryable is not None:
            self.retryable = retryable


class AuthenticationError(ModelError):
    retryable = False


class RateLimitError(ModelError):
    retryable = True


class BadRequestError(ModelError):
    retryable = False


class ContextLengthError(BadRequestError):
    retryable = False


class ServerError(ModelError):
    retryable = True


class OverloadedError(ServerError):
    retryable = True


class ModelTimeoutError(ModelError, TimeoutError):
    """The provider did not answer (or stopped answering) in time."""

    retryable = True


class ModelConnectionError(ModelError, ConnectionError):
    """The provider could not be reached."""

    retryable = True


class MalformedStreamError(ModelError):
    """The stream broke its protocol: cut off mid-message, garbage lines, missing terminator."""

    retryable = False


class HedgeError(ModelError):
    """Both attempts of a hedged model call (`HedgeMiddleware`) failed before their first token.
    ``errors`` holds each attempt's model name and error, the first attempt first; the message
    names both. ``retryable`` when either error is (trying again may help one of them)."""

    def __init__(self, errors: tuple[tuple[str, BaseException], ...]) -> None:
        parts = "; ".join(f"{model}: {type(e).__name__}: {e}" for model, e in errors)
        super().__init__(f"both attempts of the hedged model call failed ({parts})",
                         retryable=any(isinstance(e, ModelError) and e.retryable for _, e in errors))
        self.errors = errors


# -- sessions ------------------------------------------------------------------------------------


class StateStoreError(AgentScopeError):
    """The store failed (unreachable, corrupted data…). The in-memory state is kept intact."""


class StateConflictError(StateStoreError):
    """Another writer saved this session since it was loaded."""

    def __init__(self, user_id: str, session_id: str, expected: int, actual: int) -> None:
        super().__init__(
            f"state of session {user_id}/{session_id} moved: expected version {expected}, found {actual}"
        )
        self.expected = expected
        self.actual = actual


class RunLogError(AgentScopeError):
    """The run log (the per-run event log of a served agent: in memory, SQLite or Redis) failed:
    unreachable, or a run's events are no longer held. Clients hear a safe message."""


class ScheduleStoreError(AgentScopeError):
    """The store of a served agent's schedules (memory, SQLite or Redis) failed: unreachable, or
    a file it cannot write. ``/v1/schedules`` answers 503; the scheduler tries again next pass."""


# -- tools, resuming, structured output ----------------------------------------------------------


class ToolArgumentError(AgentScopeError, ValueError):
    """The model's arguments for a tool do not fit its schema (or are not JSON)."""


class ToolConflictError(AgentScopeError, ValueError):
    """Two tool sources (MCP servers) offer tools of one name: a call could reach only one of
    them. The message names both and the fix (a ``prefix=``)."""


class ToolInDoubtError(AgentScopeError):
    """A resumed run found a tool call in doubt (its intent recorded, no result: the process died
    while it ran) and could not decide whether it happened: its tool's ``reconcile`` raised, or no
    policy applies (``"reconcile"`` for a tool without a ``reconcile`` function). Nothing ran and
    the session is unchanged: the call stays in doubt. Resume again (an empty input) to try again,
    or answer it: ``confirm_message(ConfirmResult(tool_call_id=..., confirmed=True,
    answer={"done": True, "result": ...}))`` (it happened), ``answer={"done": False}`` (run it) or
    ``confirmed=False`` (skip it)."""

    def __init__(self, message: str, *, tool_call_id: str, tool_name: str, idempotency_key: str,
                 policy: str) -> None:
        super().__init__(message)
        self.tool_call_id, self.tool_name = tool_call_id, tool_name
        self.idempotency_key, self.policy = idempotency_key, policy


class ToolInputRequired(AgentScopeError):
    """Raised by a running tool that cannot go on without the user's answer (an MCP server's
    elicitation): the call pauses like a call that asks for approval — `RequireUserConfirm` with
    ``question`` in its metadata, the run stops with PERMISSION_ASKING — and runs again when the
    user resumes with ``ConfirmResult(tool_call_id, confirmed=True, answer={...})``."""

    def __init__(self, message: str, question: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.question = question or {}


class ResumeError(AgentScopeError, ValueError):
    """A resume input does not fit the pending tool calls (unknown or duplicate ids…)."""


class PendingToolCallsError(ResumeError):
    """The session has tool calls waiting for confirmation or external results: ``tool_call_ids``
    names them, ``in_doubt`` those among them whose run stopped while they ran (they may or may
    not have taken effect: answered with ``answer={"done": ...}``, see docs/tools.md)."""

    def __init__(self, message: str, *, tool_call_ids: tuple[str, ...] = (), in_doubt: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.tool_call_ids = tool_call_ids
        self.in_doubt = in_doubt


class StructuredOutputError(AgentScopeError, ValueError):
    """The model did not produce a valid structured output within the retries."""


class CassetteMismatchError(AgentScopeError, AssertionError):
    """A replayed run sent a request that differs from the recorded one (or one too many).
    ``field`` is the first differing field (``body.messages[2].content``); a test failure, hence
    an AssertionError too."""

    def __init__(self, message: str, *, index: int, field: str) -> None:
        super().__init__(message)
        self.index = index
        self.field = field


class InputError(AgentScopeError, ValueError):
    """What was passed to ``call``/``stream`` cannot be a run's input (says what to pass)."""


# -- middleware ----------------------------------------------------------------------------------


class MiddlewareError(AgentScopeError, TypeError):
    """A middleware broke the hook contract (its stream carried something that is not an event,
    or a delta without text). The message names the middleware and the point."""


class MiddlewareOrderError(AgentScopeError, ValueError):
    """The agent's middleware cannot be put in one order, found when the agent is built: ordering
    hints that form a cycle or contradict ``order()``, a ``requires`` that is not registered, or
    (with ``strict=True``) an ordering lint. ``rule`` names the check, ``middlewares`` the
    middleware concerned; the message says what to change."""

    def __init__(self, message: str, *, rule: str, middlewares: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.rule = rule
        self.middlewares = middlewares


class MiddlewareTermination(AgentScopeError):
    """Raised by a middleware to end the run on purpose (a guardrail's block, for instance)."""


class GuardrailTripped(MiddlewareTermination):
    """A guardrail stopped the run: ``guardrail`` names it, ``reason`` says why."""

    def __init__(self, guardrail: str, reason: str) -> None:
        super().__init__(f"guardrail {guardrail} tripped: {reason}")
        self.guardrail = guardrail
        self.reason = reason


class RateLimitExceeded(MiddlewareTermination):
    """A rate limit refused the call (``retry_after``: seconds until it would pass)."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class CallLimitExceeded(MiddlewareTermination):
    """A call limit was reached with ``exit_behavior="error"``: ``kind`` (``"model"`` or
    ``"tool"``), ``scope`` (``"run"``, ``"tree"`` — a root run and its sub-agents — or
    ``"session"``), ``limit``, and ``tool_name`` (None: all)."""

    def __init__(self, message: str, *, kind: str, scope: str, limit: int, tool_name: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.scope, self.limit, self.tool_name = kind, scope, limit, tool_name


class RunTimeoutError(MiddlewareTermination, TimeoutError):
    """A whole run took longer than `TimeoutMiddleware`'s ``run_timeout``."""


class BudgetExceeded(MiddlewareTermination):
    """A token or cost budget was used up (`BudgetMiddleware`). Which one: ``scope`` (``"run"``,
    ``"session"`` or ``"user"``) and ``kind`` (``"tokens"`` or ``"cost"``, USD); ``limit``, what
    was ``spent`` before the refused call, and that call's ``estimate`` (its estimated input, in
    the limit's unit). None where not known (an error made by hand with a message only)."""

    def __init__(
        self, message: str, *, scope: str | None = None, kind: str | None = None, limit: float | None = None,
        spent: float | None = None, estimate: float | None = None,
    ) -> None:
        super().__init__(message)
        self.scope = scope
        self.kind = kind
        self.limit = limit
        self.spent = spent
        self.estimate = estimate


# -- sub-agents ----------------------------------------------------------------------------------


class SubAgentError(AgentScopeError):
    """A sub-agent (`agent.as_tool`, `Toolkit.register_agent`) cannot run where it was put. At
    build time it is raised to the caller; at run time the tool call's error result names it."""


class SubAgentCycleError(SubAgentError, ValueError):
    """An agent would be its own sub-agent (directly or through others): registering it raises,
    and a cycle built around `register_agent` is refused when the call would enter it."""


class SubAgentDepthError(SubAgentError):
    """Calling the sub-agent would make the tree deeper than its ``max_depth`` (``depth`` is the
    depth the call would reach; the root is depth 0)."""

    def __init__(self, message: str, *, depth: int | None = None, max_depth: int | None = None) -> None:
        super().__init__(message)
        self.depth = depth
        self.max_depth = max_depth


class SubAgentPaused(AgentScopeError):
    """Internal: a sub-agent's run paused for the user to confirm its tool calls (``waiting``: their
    ids). Raised by the sub-agent tool to the acting core, which keeps the parent's call pending
    (a ``running`` result) and pauses the parent with PERMISSION_ASKING; it never reaches callers."""

    def __init__(self, waiting: list[str]) -> None:
        super().__init__(f"waiting for the user to confirm {', '.join(waiting)}")
        self.waiting = waiting


# -- interruption --------------------------------------------------------------------------------


class AgentInterrupted(AgentScopeError):
    """Raised inside a run that ``agent.interrupt(...)`` stopped, once the model request's read is
    cut and the tools' tasks are cancelled: an ordinary exception, raised in the run's own task,
    which an interrupt never leaves cancelled. Middleware sees it pass through its hooks (retries
    and fallbacks do not act on it); the loop turns it into an INTERRUPTED reply, so ``call``
    returns that reply rather than raising."""


# -- double texting ------------------------------------------------------------------------------


class BusyError(AgentScopeError):
    """A new input to a session that is running another: its ``multitask_strategy`` refuses to
    wait (``"reject"``), or the session's queue is full (``"enqueue"`` past ``max_queued``).
    Nothing of the input was run or remembered: send it again once the run ended (``retry_after``
    seconds is a hint), or with another strategy (``"enqueue"``, ``"interrupt"``). ``reason`` is
    ``"busy"`` or ``"queue_full"``."""

    code = "session_busy"
    """What clients of the server hear it as: an HTTP 409's ``type`` and an AG-UI RUN_ERROR's ``code``."""

    def __init__(self, user_id: str, session_id: str, *, strategy: str = "reject", reason: str = "busy",
                 retry_after: float | None = None, message: str | None = None) -> None:
        if message is None:
            if reason == "queue_full":
                message = (f"session {user_id}/{session_id} is busy and its queue of waiting inputs is full: "
                           "retry after the runs ahead of it ended, or send it with "
                           "multitask_strategy='interrupt'")
            else:
                message = (f"session {user_id}/{session_id} is running another input and "
                           f"multitask_strategy={strategy!r} refuses to wait: retry after it ended, or send it "
                           "with multitask_strategy='enqueue' (run after it) or 'interrupt' (stop it)")
        super().__init__(message)
        self.user_id, self.session_id = user_id, session_id
        self.strategy, self.reason, self.retry_after = strategy, reason, retry_after


# -- durable runs (agentscope_py.durable) --------------------------------------------------------


class DurableActivityError(AgentScopeError):
    """A durable run's model or tool activity failed for good (its retries used up, or an error
    marked not retryable). ``error_type`` is the class name of the error the activity raised,
    when it was one of the activity's own."""

    def __init__(self, message: str, *, error_type: str | None = None) -> None:
        super().__init__(message)
        self.error_type = error_type


class DurableSessionBusy(BusyError):
    """A durable run of this agent is already in flight on the session (one run per session at a
    time, as the local agent's session gate has it) and the start's ``multitask_strategy``
    refuses to wait (``reason`` ``"busy"``), or too many starts wait for it (``"queue_full"``):
    ``run_id`` is the running one's. Start with ``multitask_strategy="enqueue"`` (wait for it),
    ``"interrupt"`` or ``"rollback"`` (stop it)."""

    def __init__(self, user_id: str, session_id: str, run_id: str, *, reason: str = "busy") -> None:
        what = "and too many starts wait for it" if reason == "queue_full" else "and this start refuses to wait"
        super().__init__(user_id, session_id, reason=reason,
                         message=f"session {user_id}/{session_id} has a durable run in flight ({run_id}) {what}: "
                         "start again once it ended, or with multitask_strategy='enqueue' (wait for it), "
                         "'interrupt' or 'rollback' (stop it)")
        self.run_id = run_id


# -- MCP servers (agentscope_py.mcp) -------------------------------------------------------------


class MCPClientError(AgentScopeError):
    """Talking to an MCP server failed. ``server`` is the client's name for it."""

    def __init__(self, message: str, *, server: str | None = None) -> None:
        super().__init__(message)
        self.server = server


class MCPConnectionError(MCPClientError, ConnectionError):
    """The server could not be started or reached, its handshake failed, or it went away."""


class MCPTimeoutError(MCPClientError, TimeoutError):
    """The handshake or a request did not finish in time (the request was cancelled)."""


class MCPServerRestarted(MCPConnectionError):
    """The session died during a call that is not safe to repeat: the server was reconnected (or
    restarted) but the call was not sent again, since it may already have had its effect."""


class MCPToolError(MCPClientError):
    """The server answered a request with a protocol error (not a tool's own ``isError`` result,
    which the model sees as an error result)."""


# -- evaluation (agentscope_py.evals) ------------------------------------------------------------


class DatasetError(AgentScopeError, ValueError):
    """A dataset file does not parse, or does not match the dataset schema. The message names the
    file, the case (by name and position) and the field; ``case`` and ``field`` hold them."""

    def __init__(self, message: str, *, case: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.case = case
        self.field = field
