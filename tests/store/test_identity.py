"""Identity: ids, API keys, resume tokens, ephemeral keys, tenant isolation."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio

from session.identity import (
    ApiKeyMap,
    EphemeralKeys,
    api_key_from_request,
    authenticate,
    is_session_id,
    new_session_id,
    resume_token_from_request,
    resume_token_matches,
    secret_digest,
)
from session.store import SessionStore
from session.store.errors import ResumeTokenInvalid, SessionNotFound

pytestmark = pytest.mark.system


def test_session_ids() -> None:
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(is_session_id(i) and "{" not in i for i in ids)
    assert not is_session_id("sess_{x}") and not is_session_id("event_abc")


def test_api_key_map_from_env_and_requests() -> None:
    keys = ApiKeyMap.from_env({"OMNIDUPLEX_API_KEYS": "key1:tenantA, key2:tenantB,"})
    assert len(keys) == 2
    assert keys.tenant_for("key1") == "tenantA" and keys.tenant_for("key2") == "tenantB"
    assert keys.tenant_for("nope") is None and keys.tenant_for(None) is None
    assert ApiKeyMap.from_env({}).tenant_for("key1") is None
    with pytest.raises(ValueError):
        ApiKeyMap.parse("justakey")
    assert api_key_from_request("Bearer key1") == "key1"
    assert api_key_from_request(None, ["realtime", "openai-insecure-api-key.key2"]) == "key2"
    assert api_key_from_request("Basic xyz") is None
    assert resume_token_from_request(None, ["realtime", "omni-resume-token.rt_abc"]) == "rt_abc"
    assert resume_token_from_request(" rt_x ", []) == "rt_x"


def test_resume_token_compare() -> None:
    digest = secret_digest("rt_good")
    assert resume_token_matches("rt_good", digest)
    assert not resume_token_matches("rt_bad", digest)
    assert not resume_token_matches(None, digest)
    assert not resume_token_matches("rt_good", None)


async def test_tenant_isolation_and_resume_token(redis_client: redis.asyncio.Redis) -> None:
    store = SessionStore(redis_client)
    record, token = await store.create_session("tenantA", {"voice": "x"})
    assert (await store.get_session("tenantA", record.session_id)).config == {"voice": "x"}
    with pytest.raises(SessionNotFound):
        await store.get_session("tenantB", record.session_id)
    with pytest.raises(SessionNotFound):
        await store.load_snapshot("tenantB", record.session_id)
    with pytest.raises(SessionNotFound):  # another tenant learns nothing, not even "wrong token"
        await store.authorize_resume("tenantB", record.session_id, token)
    with pytest.raises(ResumeTokenInvalid):
        await store.authorize_resume("tenantA", record.session_id, "rt_wrong")
    with pytest.raises(ResumeTokenInvalid):
        await store.authorize_resume("tenantA", record.session_id, None)
    assert (await store.authorize_resume("tenantA", record.session_id, token)).tenant == "tenantA"
    meta = await redis_client.hgetall(store.keys(record.session_id).meta)
    assert token not in meta.values()  # only the digest is stored
    assert {str(k).split("}")[0] for k in await redis_client.keys("*")} == {f"omni:{{{record.session_id}"}


async def test_ephemeral_key_ttl_and_scope(redis_client: redis.asyncio.Redis) -> None:
    ek = EphemeralKeys(redis_client)
    secret = await ek.create("tenantA", {"model": "omni", "voice": "alloy"}, ttl_s=1.0)
    assert secret.value.startswith("ek_")
    assert await redis_client.get(f"omni:ek:{secret.value}") is None  # stored by digest only
    grant = await ek.resolve(secret.value)
    assert grant is not None and grant.tenant == "tenantA" and grant.session_config["voice"] == "alloy"
    principal = await authenticate(secret.value, ApiKeyMap(), ek)
    assert principal is not None and principal.tenant == "tenantA"
    assert principal.scoped_config == {"model": "omni", "voice": "alloy"}
    assert await authenticate("ek_forged", ApiKeyMap(), ek) is None
    await asyncio.sleep(1.2)
    assert await ek.resolve(secret.value) is None  # expired with its TTL
    once = await ek.create("tenantA", ttl_s=60)
    assert await ek.resolve(once.value, consume=True) is not None
    assert await ek.resolve(once.value) is None
