"""A real S3-protocol server on loopback for the tests: moto's server, reached through s3fs like a real store.

It runs the WSGI app that moto's ``ThreadedMotoServer`` runs (as s3fs's own test-suite does), on 127.0.0.1 and
a free port, with what tests need besides:

- ``stop()`` / ``start()``: the server goes away (connections refused) and comes back on the same port, with
  its buckets and objects (moto keeps them in this process).
- rules on the server's side for matching requests: ``delay`` them, answer them with an S3 error (``fail``),
  or take the server down when one arrives (``stop_on``: "the server died mid-upload").
- ``traffic()``: which requests arrived, and how many were in flight at once.

Every response carries ``Connection: close``, so no client keeps a connection that outlives ``stop()``.
The client side is never patched: stagesafe talks to this server through s3fs and aiobotocore as to AWS.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape

import pytest

BUCKET = "stagesafe-tests"
_REASONS = {403: "Forbidden", 404: "Not Found", 500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass
class _Rule:
    method: str
    pattern: re.Pattern
    delay: float = 0.0
    status: int | None = None
    code: str = ""
    times: int | None = None  # None: every matching request
    stop: bool = False

    def matches(self, method: str, path: str) -> bool:
        return method == self.method and self.pattern.search(path) is not None and self.times != 0


@dataclass
class Traffic:
    """Requests seen while recording: ``(method, path, start, end)`` in arrival order."""

    requests: list[tuple[str, str, float, float]] = field(default_factory=list)

    def paths(self, method: str, pattern: str = "") -> list[str]:
        return [p for m, p, _, _ in self.requests if m == method and re.search(pattern, p)]

    def max_in_flight(self, method: str, pattern: str = "") -> int:
        """The most matching requests the server was handling at one moment."""
        events = sorted(
            (t, step)
            for m, p, start, end in self.requests
            if m == method and re.search(pattern, p)
            for t, step in ((start, 1), (end, -1))
        )
        most = now = 0
        for _, step in events:  # at equal times the end (-1) sorts first: touching is not overlapping
            now += step
            most = max(most, now)
        return most


class S3Server:
    """moto's S3 on ``127.0.0.1:<free port>``; see the module docstring."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

        self._app = DomainDispatcherApplication(create_backend_app)
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._recorders: list[Traffic] = []
        self._server = None
        self._thread: threading.Thread | None = None
        self._down = True
        self._stopper: threading.Thread | None = None  # a stop() that a stop_on rule started
        self.port = 0  # chosen by the OS at the first start, kept afterwards

    # -- lifecycle --------------------------------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return not self._down

    def start(self) -> None:
        from moto.moto_server.werkzeug_app import MotoRequestHandler
        from werkzeug.serving import make_server

        if self._stopper is not None:
            self._stopper.join(timeout=10)
            self._stopper = None
        if self.running:
            return
        # Bind here, not in the thread, so that a bind error is raised here instead of hanging the caller.
        self._server = make_server("127.0.0.1", self.port, self, threaded=True, request_handler=MotoRequestHandler)
        self.port = self._server.server_port
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="moto-s3", daemon=True
        )
        self._thread.start()
        self._down = False

    def stop(self) -> None:
        """Stop answering (503 to a request already in the door), close the port, wait for the server thread."""
        self._down = True
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()  # serve_forever returns and closes the listening socket
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        self._server = self._thread = None

    # -- clients and handy views ------------------------------------------------------------------------------
    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs options for this server. botocore's own retries are off, so that stagesafe's are what a test sees
        (and a dead server fails fast); s3fs's retries of dropped connections stay as they are."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
            "config_kwargs": {"retries": {"total_max_attempts": 1}},
            **extra,
        }

    def client(self):
        """A plain botocore client, to look at and tamper with objects behind stagesafe's back."""
        import botocore.session

        return botocore.session.Session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def new_url(self, name: str = "handoff") -> str:
        """A fresh ``s3://`` folder in the test bucket; nothing is there yet."""
        return f"s3://{BUCKET}/{uuid.uuid4().hex}/{name}"

    def objects(self, url: str) -> dict[str, bytes]:
        """Every object under the folder ``url``, name relative to it -> bytes, read with boto."""
        bucket, prefix = url.removeprefix("s3://").split("/", 1)
        client = self.client()
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])]
        return {k[len(prefix) + 1 :]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}

    def put(self, url: str, name: str, data: bytes) -> None:
        bucket, prefix = url.removeprefix("s3://").split("/", 1)
        self.client().put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)

    # -- server-side rules ------------------------------------------------------------------------------------
    def delay(self, method: str, pattern: str, seconds: float) -> None:
        """Hold every matching request ``seconds`` before handling it (a slow link)."""
        self._add(_Rule(method, re.compile(pattern), delay=seconds))

    def fail(self, method: str, pattern: str, status: int, code: str, *, times: int | None = None) -> None:
        """Answer the next ``times`` matching requests (all: None) with the S3 error ``code``, HTTP ``status``."""
        self._add(_Rule(method, re.compile(pattern), status=status, code=code, times=times))

    def stop_on(self, method: str, pattern: str) -> None:
        """When a matching request arrives, the server goes down (that request gets a 503) and stays down."""
        self._add(_Rule(method, re.compile(pattern), status=503, code="ServiceUnavailable", times=1, stop=True))

    def clear_rules(self) -> None:
        with self._lock:
            self._rules.clear()

    @contextlib.contextmanager
    def traffic(self) -> Iterator[Traffic]:
        seen = Traffic()
        with self._lock:
            self._recorders.append(seen)
        try:
            yield seen
        finally:
            with self._lock:
                self._recorders.remove(seen)

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    # -- the WSGI app: rules, recording, then moto ------------------------------------------------------------
    def __call__(self, environ: dict, start_response):
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        start = time.monotonic()
        try:
            with self._lock:
                rule = next((r for r in self._rules if r.matches(method, path)), None)
                if rule is not None and rule.times is not None:
                    rule.times -= 1
            if rule is not None and rule.delay:
                time.sleep(rule.delay)
            if rule is not None and rule.stop:
                self._down = True
                self._stopper = threading.Thread(target=self.stop, daemon=True)
                self._stopper.start()
            if self._down:
                return self._error(environ, start_response, 503, "ServiceUnavailable")
            if rule is not None and rule.status is not None:
                return self._error(environ, start_response, rule.status, rule.code)

            def closing(status: str, headers: list, exc_info=None):
                headers = [(k, v) for k, v in headers if k.lower() != "connection"]
                return start_response(status, [*headers, ("Connection", "close")], exc_info)

            return self._app(environ, closing)
        finally:
            end = time.monotonic()
            with self._lock:
                for recorder in self._recorders:
                    recorder.requests.append((method, path, start, end))

    @staticmethod
    def _error(environ: dict, start_response, status: int, code: str) -> list[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        if length:
            environ["wsgi.input"].read(length)  # drain the upload, as a server that refuses it still must
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{escape(code)}</Code>'
            f"<Message>injected by the test server</Message><RequestId>test</RequestId></Error>"
        ).encode()
        start_response(
            f"{status} {_REASONS.get(status, 'Error')}",
            [("Content-Type", "application/xml"), ("Content-Length", str(len(body))), ("Connection", "close")],
        )
        return [body]


@contextlib.contextmanager
def running_server() -> Iterator[S3Server]:
    """Start the server with fake AWS credentials in the environment (nothing can reach AWS), create the test
    bucket; stop it at the end."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"the S3 tests need moto[server] and s3fs ({exc}); pip install -e '.[test,s3]'") from exc
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    with pytest.MonkeyPatch.context() as env:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ROLE_ARN"):
            env.delenv(name, raising=False)
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_CONFIG_FILE", "/dev/null")
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        server = S3Server()
        server.start()
        env.setenv("AWS_ENDPOINT_URL", server.endpoint_url)  # a client built without endpoint_url lands here too
        try:
            server.client().create_bucket(Bucket=BUCKET)
            yield server
        finally:
            server.stop()
