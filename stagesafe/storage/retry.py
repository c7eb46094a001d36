"""Retrying storage operations: which errors are transient, and exponential backoff with jitter.

No torch and no fsspec here. The storage clients' exception types (botocore, aiohttp, requests, Google, Azure)
are recognised by their qualified names, so none of those packages is imported and each is optional.

Transient: the connection failed or was cut, a timeout, throttling (``SlowDown``, HTTP 429), a server error
(HTTP 5xx but 501). Not transient: not found, access denied, bad request, and every error that is not the
storage's (a tensor that cannot be read, a hash mismatch). s3fs translates S3 errors to builtins and keeps the
botocore error as ``__cause__``; the explicit cause chain is followed, the implicit ``__context__`` is not.
"""

from __future__ import annotations

import errno
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from stagesafe.errors import InvalidArgumentError, StorageTransferError

__all__ = ["RetryPolicy", "TransferAbandoned", "call_with_retries", "is_transient"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Never retried, whatever their cause: the answer will not change by asking again.
_PERMANENT = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)

_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EAGAIN",
        "EBUSY",  # s3fs: SlowDown, ServiceUnavailable, 503, OperationAborted
        "EREMOTEIO",  # s3fs: InternalError, 500
        "ETIMEDOUT",
        "ECONNRESET",
        "ECONNREFUSED",
        "ECONNABORTED",
        "EPIPE",
        "ENETDOWN",
        "ENETUNREACH",
        "ENETRESET",
        "EHOSTDOWN",
        "EHOSTUNREACH",
    )
    if hasattr(errno, name)
)

# Qualified names of client exception classes that mean "the transfer failed, the request may succeed later".
# A class matches when any class of its MRO is listed.
_TRANSIENT_TYPES = frozenset(
    {
        "botocore.exceptions.ConnectionError",  # EndpointConnectionError, ConnectTimeoutError, ...
        "botocore.exceptions.HTTPClientError",  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
        "botocore.exceptions.IncompleteReadError",
        "botocore.parsers.ResponseParserError",  # throttling answers with broken XML (s3fs retries these too)
        "aiohttp.client_exceptions.ClientConnectionError",  # refused, reset, ServerDisconnectedError, timeouts
        "aiohttp.client_exceptions.ClientPayloadError",
        "requests.exceptions.ConnectionError",
        "requests.exceptions.Timeout",
        "requests.exceptions.ChunkedEncodingError",
        "urllib3.exceptions.ProtocolError",
        "google.auth.exceptions.TransportError",
        "azure.core.exceptions.ServiceRequestError",
        "azure.core.exceptions.ServiceResponseError",
        "asyncio.exceptions.TimeoutError",  # Python 3.10, where it is not the builtin TimeoutError
    }
)

# Error codes of S3 and S3-like stores that mean "slow down" or "try again", whatever the HTTP status.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "PriorRequestNotComplete",
    }
)


class TransferAbandoned(StorageTransferError):
    """Retrying stopped because another transfer of the same operation failed (that one's error is the news)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a storage operation is tried.

    ``attempts`` tries in all; before try ``n + 1`` the wait is ``initial_delay * 2**(n - 1)``, at most
    ``max_delay``, scaled by a random factor in [0.5, 1] so that parallel transfers do not retry in lockstep.
    The default waits about 8-15 s in all before giving up (storage clients retry inside each try as well:
    botocore, for one, tries a request up to 5 times by default).
    """

    attempts: int = 5
    initial_delay: float = 1.0
    max_delay: float = 20.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise InvalidArgumentError(f"RetryPolicy(attempts={self.attempts!r}): give a positive int (1: no retry)")
        for name in ("initial_delay", "max_delay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise InvalidArgumentError(f"RetryPolicy({name}={value!r}): give a number of seconds >= 0")
        if self.max_delay < self.initial_delay:
            raise InvalidArgumentError(
                f"RetryPolicy(max_delay={self.max_delay!r}) is below initial_delay={self.initial_delay!r}"
            )

    def delay(self, failed_attempts: int, *, rng: random.Random | None = None) -> float:
        """Seconds to wait after ``failed_attempts`` failed tries, before the next one."""
        ceiling = min(self.max_delay, self.initial_delay * 2.0 ** (failed_attempts - 1))
        return ceiling * (rng or random).uniform(0.5, 1.0)


def is_transient(exc: BaseException) -> bool:
    """Whether trying the operation that raised ``exc`` again may succeed."""
    if isinstance(exc, _PERMANENT):
        return False
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if _transient_itself(link):
            return True
        link = link.__cause__
    return False


def _transient_itself(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):  # builtins: refused, reset, broken pipe, socket timeout
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if any(f"{cls.__module__}.{cls.__qualname__}" in _TRANSIENT_TYPES for cls in type(exc).__mro__):
        return True
    response = getattr(exc, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        error = response.get("Error") or {}
        if error.get("Code") in _TRANSIENT_CODES:
            return True
        if _transient_status((response.get("ResponseMetadata") or {}).get("HTTPStatusCode")):
            return True
    # aiohttp ClientResponseError.status, azure HttpResponseError.status_code, gcsfs HttpError.code
    return any(_transient_status(getattr(exc, attr, None)) for attr in ("status_code", "status", "code"))


def _transient_status(status: object) -> bool:
    if isinstance(status, bool) or not isinstance(status, int):
        return False
    return status in (408, 429) or (500 <= status <= 599 and status != 501)


def call_with_retries(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    what: str,
    hint: str = "",
    stop: threading.Event | None = None,
) -> T:
    """``fn()``, tried again after transient errors as ``policy`` says; other errors propagate at once.

    When every try failed, raises :class:`StorageTransferError` saying ``what`` could not be done (``"upload
    shard 'x' to 's3://b/run'"``), how often it was tried, and the last error (also its ``__cause__``);
    ``hint`` is appended. ``stop``, once set (another transfer of the same operation failed), ends the waiting.
    """
    start = time.monotonic()
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            last = exc
        if attempt == policy.attempts:
            break
        delay = policy.delay(attempt)
        log.warning(
            "stagesafe: could not %s (%s: %s); try %d of %d failed, trying again in %.1f s",
            what,
            type(last).__name__,
            _one_line(last),
            attempt,
            policy.attempts,
            delay,
        )
        if stop is not None:
            if stop.wait(delay):
                raise TransferAbandoned(
                    f"could not {what}: gave up after {attempt} tries because another transfer of the same "
                    f"operation failed; the last error: {type(last).__name__}: {_one_line(last)}"
                ) from last
        else:
            time.sleep(delay)
    tries = "1 try" if policy.attempts == 1 else f"{policy.attempts} tries"
    raise StorageTransferError(
        f"could not {what}: {tries} over {time.monotonic() - start:.1f} s all failed with transient errors, the "
        f"last {type(last).__name__}: {_one_line(last)}. The store is unreachable or overloaded: check "
        "endpoint_url and the network, then try again (retry=RetryPolicy(attempts=...) tries longer)" + hint
    ) from last


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."
