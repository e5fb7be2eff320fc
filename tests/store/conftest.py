from tests.conftest_redis import embedded_redis, redis_client, redis_server, redis_url  # noqa: F401
