"""Fixtures of the registry tests: one real etcd server for the module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._etcd_server import EtcdServer, run_etcd


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    """A real etcd on loopback, shared by the session; each test takes its own prefix."""
    with run_etcd() as server:
        yield server
