"""Calls belong to the token that created them; /healthz and /metrics say little without one
(issue 11, finding 4)."""

from __future__ import annotations

import logging

import pytest
from api_helpers import api, expect_error, open_call

from voicertc.config import config_from_dict
from voicertc.errors import ConfigError
from voicertc.webrtc import patch_aioice_loopback

A, B, ADMIN = "token-a-3f9", "token-b-77c", "admin-token-e21"
AUTH = {"tokens": [A, B], "admin_tokens": [ADMIN]}
FRAG = {"Content-Type": "application/trickle-ice-sdpfrag"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


async def test_another_token_cannot_see_or_touch_a_call():
    async with api(auth=AUTH) as client:
        call_id, _peer = await open_call(client, headers=bearer(A))
        url = f"/v1/calls/{call_id}"
        other = bearer(B)
        await expect_error(await client.get(url, headers=other), 404, "unknown_call")
        await expect_error(
            await client.post(f"{url}/speak", json={"text": "Hi."}, headers=other), 404, "unknown_call"
        )
        await expect_error(await client.post(f"{url}/interrupt", headers=other), 404, "unknown_call")
        await expect_error(await client.get(f"{url}/events", headers=other), 404, "unknown_call")
        patch = await client.patch(url, data="a=end-of-candidates\r\n", headers={**FRAG, **other})
        await expect_error(patch, 404, "unknown_call")
        await expect_error(await client.delete(url, headers=other), 404, "unknown_call")
        # the same answer as for a call that never existed: no existence oracle
        missing = await (await client.get("/v1/calls/0123456789abcdef", headers=other)).json()
        theirs = await (await client.get(url, headers=other)).json()
        assert missing["error"]["code"] == theirs["error"]["code"]
        assert (await client.get(url, headers=bearer(A))).status == 200
        resp = await client.post(f"{url}/speak", json={"text": "Mine."}, headers=bearer(A))
        assert resp.status == 202


async def test_admin_tokens_reach_every_call():
    async with api(auth=AUTH) as client:
        call_id, _peer = await open_call(client, headers=bearer(A))
        url = f"/v1/calls/{call_id}"
        assert (await client.get(url, headers=bearer(ADMIN))).status == 200
        assert (await client.delete(url, headers=bearer(ADMIN))).status == 200
        await expect_error(await client.get(url, headers=bearer(A)), 404, "unknown_call")


async def test_healthz_is_liveness_only_without_a_token():
    async with api(auth=AUTH) as client:
        await open_call(client, headers=bearer(A))
        resp = await client.get("/healthz")
        assert resp.status == 200 and await resp.json() == {"status": "ok"}
        wrong = await client.get("/healthz", headers=bearer("nope"))
        assert wrong.status == 200 and await wrong.json() == {"status": "ok"}
        mine = await (await client.get("/healthz", headers=bearer(A))).json()
        assert mine["voices"] == ["tone", "silence"] and mine["active_calls"] == 1
        assert (await (await client.get("/healthz", headers=bearer(B))).json())["active_calls"] == 0
        assert (await (await client.get("/healthz", headers=bearer(ADMIN))).json())["active_calls"] == 1


async def test_protect_metrics():
    async with api(auth={**AUTH, "protect_metrics": True}) as client:
        await expect_error(await client.get("/metrics"), 401, "unauthorized")
        await expect_error(await client.get("/metrics", headers=bearer("nope")), 403, "forbidden")
        await expect_error(await client.get("/metrics", headers=bearer(A)), 403, "forbidden")
        resp = await client.get("/metrics", headers=bearer(ADMIN))
        assert resp.status == 200 and "voicertc_active_calls" in await resp.text()
    async with api(auth={"tokens": [A], "protect_metrics": True}) as client:
        await expect_error(await client.get("/metrics"), 401, "unauthorized")
        assert (await client.get("/metrics", headers=bearer(A))).status == 200
    async with api(auth={"tokens": [A]}) as client:
        assert (await client.get("/metrics")).status == 200  # protect_metrics is off by default


async def test_tokens_are_never_logged(caplog):
    caplog.set_level(logging.DEBUG)
    async with api(auth=AUTH) as client:
        call_id, peer = await open_call(client, headers=bearer(A))
        resp = await client.post(f"/v1/calls/{call_id}/speak", json={"text": "Quiet."}, headers=bearer(A))
        await peer.wait_event("speech.done", utterance_id=(await resp.json())["utterance_id"])
        await client.get(f"/v1/calls/{call_id}", headers=bearer(B))
        await client.get("/metrics", headers=bearer(ADMIN))
        await client.delete(f"/v1/calls/{call_id}", headers=bearer(A))
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "call" in logged and all(token not in logged for token in (A, B, ADMIN))


@pytest.mark.parametrize(
    ("auth", "key"),
    [
        ({"admin_tokens": [""]}, "auth.admin_tokens"),
        ({"admin_tokens": "x"}, "auth.admin_tokens"),
        ({"protect_metrics": True}, "auth.protect_metrics"),
        ({"protect_metrics": "yes", "tokens": ["a"]}, "auth.protect_metrics"),
    ],
)
def test_auth_config_errors_name_the_key(auth, key):
    with pytest.raises(ConfigError, match=key):
        config_from_dict({"auth": auth})
