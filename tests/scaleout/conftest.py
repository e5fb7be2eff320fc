from tests.conftest_redis import redis_client, redis_server, redis_url  # noqa: F401
