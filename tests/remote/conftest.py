from tests.conftest_redis import redis_server, redis_url  # noqa: F401
