"""Fixtures of smalti-checkpoint's tests: smalti-testing's fault proxy in front of the loopback S3 server."""

from __future__ import annotations

import pytest


@pytest.fixture
def faulty_s3(s3_server, fault_proxy, monkeypatch):
    """A :class:`smalti.testing.fault_proxy.FaultProxy` in front of the loopback S3 server; ``S3_ENDPOINT_URL``
    points at the proxy, so every store opened in the test goes through it."""
    proxy = fault_proxy(s3_server.endpoint_url)
    monkeypatch.setenv("S3_ENDPOINT_URL", proxy.url)
    return proxy
