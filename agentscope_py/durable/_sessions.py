"""A durable run's session in the agent's own store: the workflow loads it at the start of every
turn and saves it at the end through two activities (``agentscope.load_state`` /
``agentscope.save_state``) that run on a worker with the store the factory configured (SQLite,
Redis…), so a second run on the session remembers the first — on any worker, after any restart.

The workflow never touches the store itself (its loop has no I/O): `ActivityStateStore` is what
the workflow's agent sees as its store, and each call is an activity. A factory whose store is
the default `InMemoryStateStore` keeps the session in the workflow only (a worker's memory is not
shared by the other workers): see `session_store`."""

from __future__ import annotations

from typing import Any

from temporalio import activity, workflow
from temporalio.exceptions import ActivityError, ApplicationError

from ..agent.state import AgentState
from ..agent.store import AgentStateStore, InMemoryStateStore
from ..errors import StateConflictError, StateStoreError
from ..message import Msg
from ._config import LOAD_STATE_ACTIVITY, SAVE_STATE_ACTIVITY, ActivityConfig
from ._factory import worker_agent
from ._publish import StableIds

__all__ = ["ActivityStateStore", "failure", "load_state_activity", "save_state_activity", "session_store"]


def session_store(factory_store: AgentStateStore, factory: str, config: ActivityConfig,
                  ids: StableIds) -> AgentStateStore:
    """The store the workflow's agent uses: activities on the workers' store, or (for the
    default in-memory store, which no two workers share) a store in the workflow. ``ids``: the
    names the run's events get (`Journal.ids`), which what it saves gets too (`ActivityStateStore`)."""
    if isinstance(factory_store, InMemoryStateStore):
        return InMemoryStateStore()
    return ActivityStateStore(factory, config, ids)


class ActivityStateStore:
    """`AgentStateStore` for the workflow: every load and save is an activity on a worker.

    The ids a run makes (its messages', its replies') are made per process, so a replay of the
    workflow makes others, while the session keeps what the first execution saved (the save's
    activity is not run again). What is saved is therefore named by the journal's names (``ids``:
    by order of first appearance, the same on every replay), and the run's reply is returned
    under them (`named`): the reply a replayed run returns is the one its session holds, and
    its id is the one the run's events gave it. The ids the session had when loaded keep
    their names."""

    def __init__(self, factory: str, config: ActivityConfig, ids: StableIds) -> None:
        self.factory, self.config, self.ids = factory, config, ids

    def named(self, msg: Msg) -> dict[str, Any]:
        """``msg`` (JSON) with the names its ids have in the session."""
        named: dict[str, Any] = self.ids.rename(msg.model_dump(mode="json"))
        return named

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]:
        out = await self._call(LOAD_STATE_ACTIVITY, {"user_id": user_id, "session_id": session_id},
                               f"loading session {user_id}/{session_id}")
        state = None if out["state"] is None else AgentState.from_json(out["state"])
        if state is not None:
            self.ids.keep(state.model_dump(mode="json"))
        return state, int(out["version"])

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        named = AgentState.model_validate(self.ids.rename(state.model_dump(mode="json")))
        payload = {"user_id": user_id, "session_id": session_id, "state": named.to_json(),
                   "version": expected_version}
        return int(await self._call(SAVE_STATE_ACTIVITY, payload, f"saving session {user_id}/{session_id}"))

    async def _call(self, name: str, payload: dict[str, Any], what: str) -> Any:
        try:
            return await workflow.execute_activity(name, {"factory": self.factory, **payload},
                                                   **self.config.options())
        except ActivityError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == "StateConflictError":
                expected, actual = cause.details if len(cause.details) == 2 else (-1, -1)
                raise StateConflictError(payload["user_id"], payload["session_id"], expected, actual) from None
            message = cause.message if isinstance(cause, ApplicationError) else str(cause or exc)
            raise StateStoreError(f"{what} failed on the worker: {message}") from None


def failure(exc: Exception) -> ApplicationError:
    """The activity's error for Temporal: a version conflict or a corrupted state is final (no
    retry can change it); a store that is down is retried as configured."""
    if isinstance(exc, StateConflictError):
        return ApplicationError(str(exc), exc.expected, exc.actual, type="StateConflictError", non_retryable=True)
    corrupted = isinstance(exc, StateStoreError) and isinstance(exc.__cause__, ValueError)
    return ApplicationError(str(exc), type=type(exc).__name__, non_retryable=corrupted)


@activity.defn(name=LOAD_STATE_ACTIVITY)
async def load_state_activity(payload: dict[str, Any]) -> dict[str, Any]:
    """The session's state (as JSON, or None) and version, from the worker's agent's store."""
    store = worker_agent(payload["factory"]).state_store
    try:
        state, version = await store.load(payload["user_id"], payload["session_id"])
    except Exception as exc:
        raise failure(exc) from exc
    return {"state": None if state is None else state.to_json(), "version": version}


@activity.defn(name=SAVE_STATE_ACTIVITY)
async def save_state_activity(payload: dict[str, Any]) -> int:
    """Save the session's state if its version is still ``version``: the new version."""
    store = worker_agent(payload["factory"]).state_store
    user_id, session_id, version = payload["user_id"], payload["session_id"], payload["version"]
    state = AgentState.from_json(payload["state"])
    try:
        return await store.save(user_id, session_id, state, version)
    except StateConflictError as exc:
        # An earlier attempt may have saved and died before reporting it: the store then holds
        # this very state at the next version, and the save is done.
        try:
            stored, current = await store.load(user_id, session_id)
        except Exception:
            stored, current = None, -1
        if current == version + 1 and stored is not None and stored.to_json() == state.to_json():
            return current
        raise failure(exc) from exc
    except Exception as exc:
        raise failure(exc) from exc
