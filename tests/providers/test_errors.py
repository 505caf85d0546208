"""The provider-neutral error mapping, and what a missing provider extra says."""

from __future__ import annotations

import email.utils
import importlib
import sys
import time

import pytest

from agentscope_py.model import (
    AuthenticationError,
    BadRequestError,
    ContextLengthError,
    ModelError,
    OverloadedError,
    RateLimitError,
    ServerError,
)
from agentscope_py.model import (
    ModelTimeoutError as TimeoutError,
)
from agentscope_py.model._errors import error_from_body, error_from_status, parse_retry_after


def test_retry_after_forms() -> None:
    assert parse_retry_after({"retry-after": "3"}) == 3.0
    assert parse_retry_after({"retry-after": "1.5"}) == 1.5
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert parse_retry_after({"retry-after": "-4"}) == 0.0
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({}) is None and parse_retry_after(None) is None
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 < parse_retry_after({"retry-after": when}) <= 30  # type: ignore[operator]


@pytest.mark.parametrize(("status", "message", "expected", "retryable"), [
    (401, "bad key", AuthenticationError, False),
    (403, "forbidden", AuthenticationError, False),
    (429, "slow down", RateLimitError, True),
    (408, "request timeout", TimeoutError, True),
    (400, "maximum context length is 4096 tokens", ContextLengthError, False),
    (400, "input is too long for the model", ContextLengthError, False),
    (400, "bad temperature", BadRequestError, False),
    (404, "model not found", BadRequestError, False),
    (500, "oops", ServerError, True),
    (502, "bad gateway", ServerError, True),
    (503, "unavailable", ServerError, True),
    (529, "overloaded", OverloadedError, True),
])
def test_status_mapping(status: int, message: str, expected: type[ModelError], retryable: bool) -> None:
    error = error_from_status(status, message, provider="p")
    assert type(error) is expected
    assert error.retryable is retryable and error.status_code == status and error.provider == "p"
    assert str(error) == f"p: {message}"


def test_overloaded_error_type_wins_over_its_status() -> None:
    body = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert type(error_from_status(503, "Overloaded", provider="p", body=body)) is OverloadedError


@pytest.mark.parametrize(("body", "expected"), [
    ({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, OverloadedError),
    ({"error": {"type": "rate_limit_error", "message": "x"}}, RateLimitError),
    ({"error": {"type": "invalid_request_error", "message": "prompt is too long"}}, ContextLengthError),
    ({"error": {"type": "invalid_request_error", "message": "bad"}}, BadRequestError),
    ({"error": {"message": "x", "code": "context_length_exceeded"}}, ContextLengthError),
    ({"error": {"message": "x", "code": 429}}, RateLimitError),
    ({"error": {"message": "no type at all"}}, ServerError),
    ({"error": "plain string error"}, ServerError),
])
def test_stream_error_bodies(body: object, expected: type[ModelError]) -> None:
    assert type(error_from_body(body, provider="p")) is expected


@pytest.mark.parametrize(("sdk", "module", "extra"), [
    ("openai", "openai", "openai"),
    ("anthropic", "anthropic", "anthropic"),
    ("ollama", "ollama", "ollama"),
])
def test_missing_sdk_names_the_install_command(monkeypatch: pytest.MonkeyPatch, sdk: str, module: str,
                                               extra: str) -> None:
    monkeypatch.setitem(sys.modules, sdk, None)  # type: ignore[arg-type]  # makes `import sdk` fail
    monkeypatch.delitem(sys.modules, f"agentscope_py.model.{module}", raising=False)
    with pytest.raises(ImportError, match=rf'pip install "agentscope-py\[{extra}\]"'):
        importlib.import_module(f"agentscope_py.model.{module}")


def test_llama_server_context_overflow_is_a_context_length_error() -> None:
    # llama.cpp's C++ server, on all three of its protocols, for a prompt past --ctx-size.
    message = "request (10096 tokens) exceeds the available context size (4096 tokens), try increasing it"
    body = {"error": {"code": 400, "message": message, "type": "exceed_context_size_error",
                      "n_prompt_tokens": 10096, "n_ctx": 4096}}
    error = error_from_status(400, message, provider="p", body=body)
    assert type(error) is ContextLengthError and not error.retryable
    assert type(error_from_status(400, "x", provider="p", body=body)) is ContextLengthError  # by its type alone
