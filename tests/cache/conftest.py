from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest

from encdisagg.cache import (
    MooncakeEmbeddingStore,
    entry_header,
    open_mooncake_store,
    parse_global_cache_url,
)
from encdisagg.models import QwenVisionModel, load_model

from ._cluster import Cluster, run_cluster
from .fakes import png


@pytest.fixture
def listening() -> Iterator[int]:
    """A loopback port that accepts connections (the reachability probe's target)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


@pytest.fixture(scope="session")
def tiny() -> QwenVisionModel:
    return load_model("tiny")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with run_cluster(tmp_path_factory.mktemp("mooncake")) as running:
        yield running


def wait_until_writable(store: MooncakeEmbeddingStore) -> None:
    """The storage process mounts its memory shortly after it listens; wait for that."""
    import torch

    from encdisagg.transfer import payload_view

    header = entry_header(0, 1, torch.float32, (1,))
    deadline = time.monotonic() + 20
    while True:
        try:
            store.put("readiness-probe", header, payload_view(torch.zeros(0)))
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        else:
            store.remove("readiness-probe")
            return


@pytest.fixture(scope="module")
def store(cluster: Cluster) -> Iterator[MooncakeEmbeddingStore]:
    """A client of the cluster's store, for looking at (and tampering with) entries."""
    client = open_mooncake_store(parse_global_cache_url(cluster.url()))
    try:
        wait_until_writable(client)
        yield client
    finally:
        client.close()


@pytest.fixture
def salt(anyio_backend_name: str) -> str:
    """Differs per backend run, so a test's entries from one run never serve the other."""
    return anyio_backend_name


@pytest.fixture
def image(salt: str) -> Callable[..., bytes]:
    """``image(seed, width=56, height=56)``: a PNG unique to this seed and backend run."""
    offset = {"asyncio": 0, "trio": 100_000}.get(salt, 200_000)

    def make(seed: int, width: int = 56, height: int = 56) -> bytes:
        return png(seed + offset, width, height)

    return make
