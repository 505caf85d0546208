"""Retries and fallback of a model call before its first chunk (`_model_call.ModelEvents`' first
read): the policy, and the attempts after the first one failed."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ..model.base import ChatChunk, ChatModel, ModelError, ModelRequest

__all__ = ["FailoverListener", "RetryPolicy", "close_quietly", "recover"]

FailoverListener = Callable[[ChatModel, BaseException, ChatModel], Any]


class RetryPolicy:
    """Retries of retryable errors that happen before the first chunk: exponential backoff with
    full jitter, honouring the provider's retry-after."""

    __slots__ = ("base_delay", "max_delay", "max_retries")

    def __init__(self, max_retries: int = 0, base_delay: float = 0.5, max_delay: float = 20.0) -> None:
        self.max_retries = max_retries
        self.base_delay = base_delay
        self.max_delay = max_delay

    def delay(self, attempt: int, error: BaseException) -> float:
        hint = getattr(error, "retry_after", None)
        if isinstance(hint, int | float) and hint >= 0:
            return min(float(hint), self.max_delay)
        return random.uniform(0, min(self.max_delay, self.base_delay * (2**attempt)))


def _retryable(error: BaseException) -> bool:
    return isinstance(error, ModelError) and error.retryable


async def recover(
    models: Sequence[ChatModel],
    request: ModelRequest,
    policy: RetryPolicy,
    on_failover: FailoverListener | None,
    error: Exception,
) -> tuple[ChatModel, AsyncIterator[ChatChunk], ChatChunk | None]:
    """The first attempt (``models[0]``) failed with ``error``: retry retryable errors as the
    policy says, then fail over to the next model, until one produces a chunk (or ends cleanly)."""
    i, attempt = 0, 0
    while True:
        if _retryable(error) and attempt < policy.max_retries:
            await asyncio.sleep(policy.delay(attempt, error))
            attempt += 1
        elif i + 1 < len(models):
            if on_failover is not None:
                on_failover(models[i], error, models[i + 1])
            i, attempt = i + 1, 0
        else:
            raise error
        model = models[i]
        it: AsyncIterator[ChatChunk] | None = None
        try:
            it = model.stream(request).__aiter__()
            return model, it, await it.__anext__()
        except StopAsyncIteration:
            assert it is not None
            return model, it, None
        except Exception as exc:
            if it is not None:
                await close_quietly(it)
            error = exc


async def close_quietly(it: Any) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        try:  # noqa: SIM105 - cheaper than contextlib.suppress, once per model call
            await close()
        except Exception:
            pass
