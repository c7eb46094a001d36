"""Which storage errors are retried, and how: on real exception objects of botocore, s3fs and aiohttp."""

from __future__ import annotations

import ast
import errno
import pathlib
import random
import threading

import pytest

import stagesafe.storage.retry
from stagesafe.storage.retry import RetryPolicy, TransferAbandoned, call_with_retries, is_transient
from stagesafe.errors import HandoffCorruptError, InvalidArgumentError, StorageTransferError

NO_WAIT = RetryPolicy(attempts=3, initial_delay=0, max_delay=0)


def test_pure_module_imports_neither_torch_nor_fsspec_nor_a_storage_client():
    tree = ast.parse(pathlib.Path(stagesafe.storage.retry.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported.isdisjoint({"torch", "fsspec", "botocore", "aiohttp", "s3fs", "requests"})


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")


def _s3fs(code: str, status: int) -> BaseException:
    """The exception s3fs raises for an S3 error answer: a builtin, the botocore error as its cause."""
    from s3fs.errors import translate_boto_error

    return translate_boto_error(_client_error(code, status))


def _cases_of_the_s3_extra():
    import aiohttp
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

    yield "connection refused (botocore)", EndpointConnectionError(endpoint_url="http://x"), True
    yield "connection closed (botocore)", ConnectionClosedError(endpoint_url="http://x"), True
    yield "read timeout (botocore)", ReadTimeoutError(endpoint_url="http://x"), True
    yield "server disconnected (aiohttp)", aiohttp.ServerDisconnectedError(), True
    yield "502 (aiohttp)", aiohttp.ClientResponseError(None, (), status=502), True
    yield "404 (aiohttp)", aiohttp.ClientResponseError(None, (), status=404), False
    yield "InternalError via s3fs", _s3fs("InternalError", 500), True
    yield "SlowDown via s3fs", _s3fs("SlowDown", 503), True
    yield "unknown code, 504, via s3fs", _s3fs("GatewayTimeout", 504), True
    yield "Throttling with a 400, via s3fs", _s3fs("Throttling", 400), True
    yield "RequestTimeout via s3fs", _s3fs("RequestTimeout", 400), True
    yield "NotImplemented 501 via s3fs", _s3fs("NotImplemented", 501), False
    yield "NoSuchKey via s3fs", _s3fs("NoSuchKey", 404), False
    yield "NoSuchBucket via s3fs", _s3fs("NoSuchBucket", 404), False
    yield "AccessDenied via s3fs", _s3fs("AccessDenied", 403), False
    yield "InvalidArgument via s3fs", _s3fs("InvalidArgument", 400), False
    yield "ClientError SlowDown untranslated", _client_error("SlowDown", 503), True
    yield "ClientError AccessDenied untranslated", _client_error("AccessDenied", 403), False


def _builtin_cases():
    yield "connection reset", ConnectionResetError(errno.ECONNRESET, "reset"), True
    yield "socket timeout", TimeoutError("timed out"), True
    yield "disk full", OSError(errno.ENOSPC, "No space left on device"), False
    yield "a missing file", FileNotFoundError(errno.ENOENT, "gone"), False
    yield "a corrupt shard", HandoffCorruptError("sha256 differs"), False
    yield "a bug", RuntimeError("device lost"), False


def _transient_cases() -> list:
    """Every case; those of the s3 extra's libraries skipped where it is not installed (an image without it)."""
    cases = [pytest.param(e, t, id=i) for i, e, t in _builtin_cases()]
    try:
        cases += [pytest.param(e, t, id=i) for i, e, t in _cases_of_the_s3_extra()]
    except ImportError as exc:
        cases.append(pytest.param(None, None, id="s3 extra", marks=pytest.mark.skip(reason=f"stagesafe[s3]: {exc}")))
    return cases


@pytest.mark.parametrize(("exc", "expected"), _transient_cases())
def test_is_transient(exc, expected):
    assert is_transient(exc) is expected


def test_the_explicit_cause_counts_the_implicit_context_does_not():
    wrapped = RuntimeError("upload failed")
    wrapped.__cause__ = ConnectionResetError()
    assert is_transient(wrapped)
    unrelated = ValueError("bad value")
    unrelated.__context__ = ConnectionResetError()  # raised while handling it, not because of it
    assert not is_transient(unrelated)
    missing = FileNotFoundError("gone")
    missing.__cause__ = ConnectionResetError()  # a refusal stays a refusal
    assert not is_transient(missing)


def test_retries_until_success_and_logs_each_failure(caplog):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError(errno.ECONNRESET, "reset by peer")
        return "done"

    assert call_with_retries(flaky, policy=NO_WAIT, what="write shard 'a' to 's3://b/r'") == "done"
    assert len(calls) == 3
    assert caplog.text.count("could not write shard 'a' to 's3://b/r' (ConnectionResetError") == 2
    assert "try 2 of 3 failed" in caplog.text


def test_gives_up_after_the_attempts_with_the_last_error_as_cause():
    errors = [TimeoutError(f"timeout {i}") for i in range(3)]
    it = iter(errors)

    def down():
        raise next(it)

    with pytest.raises(
        StorageTransferError, match=r"could not read x: 3 tries over .* the last TimeoutError: timeout 2"
    ) as info:
        call_with_retries(down, policy=NO_WAIT, what="read x", hint="; more")
    assert info.value.__cause__ is errors[2]
    assert str(info.value).endswith("; more")
    assert isinstance(info.value, OSError)


def test_other_errors_are_raised_at_once():
    calls = []

    def denied():
        calls.append(1)
        raise PermissionError("Access Denied")

    with pytest.raises(PermissionError):
        call_with_retries(denied, policy=NO_WAIT, what="x")
    assert len(calls) == 1


def test_a_stop_ends_the_waiting():
    stop = threading.Event()
    stop.set()

    def down():
        raise ConnectionRefusedError()

    policy = RetryPolicy(attempts=5, initial_delay=60, max_delay=60)
    with pytest.raises(TransferAbandoned, match="another transfer of the same operation failed"):
        call_with_retries(down, policy=policy, what="x", stop=stop)


def test_backoff_doubles_up_to_the_cap_with_jitter():
    policy = RetryPolicy(attempts=8, initial_delay=1.0, max_delay=5.0)
    rng = random.Random(0)
    for failed, ceiling in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (7, 5.0)):
        for _ in range(20):
            assert ceiling / 2 <= policy.delay(failed, rng=rng) <= ceiling


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attempts": 0},
        {"attempts": True},
        {"attempts": 2.0},
        {"initial_delay": -1},
        {"max_delay": float("inf")},
        {"initial_delay": 3, "max_delay": 1},
    ],
)
def test_policy_rejects_nonsense(kwargs):
    with pytest.raises(InvalidArgumentError, match="RetryPolicy"):
        RetryPolicy(**kwargs)
