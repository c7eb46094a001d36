"""Shared fixtures. The S3 server starts only when a test asks for it (moto is slow to import)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 and a free port, for the whole session (see tests/_s3.py)."""
    from _s3 import running_server

    with running_server() as server:
        yield server


@pytest.fixture
def s3(s3_server):
    """The session's S3 server, running and without rules, however the previous test left it."""
    s3_server.clear_rules()
    s3_server.start()
    yield s3_server
    s3_server.clear_rules()
    s3_server.start()
