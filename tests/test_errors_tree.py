"""One exception tree (agentscope_py.errors): a common base, builtin kinds where one fits, and the
old names that shadowed builtins kept as deprecated aliases."""

from __future__ import annotations

import asyncio
import warnings

import pytest

import agentscope_py
from agentscope_py import errors
from agentscope_py.model import ModelConnectionError, ModelError, ModelTimeoutError


def test_every_public_error_has_the_common_base() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.AgentScopeError), name
    # An interrupt is an ordinary exception (raised once the run's child tasks are cancelled),
    # not a cancellation of the run's task.
    assert not issubclass(errors.AgentInterrupted, asyncio.CancelledError)


def test_model_errors_are_also_the_builtin_kinds() -> None:
    err = ModelTimeoutError("slow", provider="openai")
    assert isinstance(err, ModelError) and isinstance(err, TimeoutError) and err.retryable
    try:
        raise ModelConnectionError("refused")
    except ConnectionError as caught:  # a plain `except ConnectionError` catches it
        assert isinstance(caught, ModelError)
    assert issubclass(errors.ToolArgumentError, ValueError)
    assert issubclass(errors.PendingToolCallsError, errors.ResumeError)
    assert issubclass(errors.StateConflictError, errors.StateStoreError)
    assert issubclass(errors.GuardrailTripped, errors.MiddlewareTermination)


def test_the_old_names_still_import_with_a_deprecation_warning() -> None:
    import agentscope_py.model as model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = model.TimeoutError  # type: ignore[attr-defined]
    assert old is ModelTimeoutError
    assert any(issubclass(w.category, DeprecationWarning) and "ModelTimeoutError" in str(w.message) for w in caught)
    with pytest.raises(AttributeError):
        model.NoSuchError  # type: ignore[attr-defined]  # noqa: B018


def test_the_names_used_before_stay_importable_where_they_were() -> None:
    from agentscope_py.agent import StateConflictError, StateStoreError
    from agentscope_py.agent.store import StateStoreError as FromStore
    from agentscope_py.tool.toolkit import ToolArgumentError

    assert StateStoreError is FromStore is errors.StateStoreError
    assert StateConflictError is errors.StateConflictError
    assert ToolArgumentError is errors.ToolArgumentError
    assert agentscope_py.AgentInterrupted is errors.AgentInterrupted
    assert agentscope_py.AgentScopeError is errors.AgentScopeError
