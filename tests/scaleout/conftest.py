"""Fixtures: one redis-server per module, a separate Redis database per cluster.

``shared`` is one gateway and two replicas for the whole module (tests that leave both
replicas running and close their sessions); ``two_replicas`` is a fresh deployment for a test
that kills, stops or drains a replica. Each cluster gets its own database of the module's
redis-server, so registries and sessions never meet.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest_redis import RedisServerProcess, start_tcp_redis
from tests.scaleout.cluster import Cluster, cluster

REDIS_DATABASES = 16  # redis-server's default


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServerProcess]:
    server = start_tcp_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fresh_db(module_redis: RedisServerProcess) -> Callable[[], str]:
    """A URL of a database of the module's server that nothing used yet."""
    numbers = itertools.count()
    base = module_redis.url.rsplit("/", 1)[0]

    def next_url() -> str:
        n = next(numbers)
        if n >= REDIS_DATABASES:
            raise RuntimeError("more clusters in one module than Redis has databases")
        return f"{base}/{n}"

    return next_url


@pytest.fixture(scope="module")
def shared(fresh_db: Callable[[], str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(fresh_db(), tmp_path_factory.mktemp("shared")) as c:
        yield c


@pytest.fixture
def two_replicas(fresh_db: Callable[[], str], tmp_path: Path) -> Iterator[Cluster]:
    with cluster(fresh_db(), tmp_path) as c:
        yield c


@pytest.fixture
def db_url(fresh_db: Callable[[], str]) -> str:
    return fresh_db()
