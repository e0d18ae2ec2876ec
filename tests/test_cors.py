"""CORS on /v1 (`[server] cors_origins`): a page served on another loopback port calls the API from
headless Chromium (preflighted: it sends a bearer token and SDP); a page on an origin not listed is
blocked by the browser because it gets no CORS headers; raw preflights and responses say exactly that."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from api_helpers import api
from browser_helpers import browser_page

from signaling.routes import REGISTRY

pytestmark = [pytest.mark.browser]

PAGE = "<!doctype html><title>another origin</title><p>a web app on another origin</p>"
TOKEN = "tok-cors"
EXPOSED = {"location", "link", "retry-after"}

# Runs in the page: a recvonly offer posted to the API, the ICE hand-out, an error body, a hang-up.
CALL_FROM_PAGE = """async ([api, token]) => {
  const auth = { Authorization: `Bearer ${token}` };
  const pc = new RTCPeerConnection();
  pc.addTransceiver("audio", { direction: "recvonly" });
  await pc.setLocalDescription(await pc.createOffer());
  try {
    const created = await fetch(api + "/v1/calls", {
      method: "POST", headers: { "Content-Type": "application/sdp", ...auth }, body: pc.localDescription.sdp,
    });
    const location = created.headers.get("Location");
    const ice = await (await fetch(api + "/v1/ice-servers", { headers: auth })).json();
    const missing = await fetch(api + "/v1/calls/nope", { headers: auth });
    const hungUp = await fetch(api + location, { method: "DELETE", headers: auth });
    return { status: created.status, location, link: created.headers.get("Link"), ice,
             missing: [missing.status, await missing.json()], hungUp: hungUp.status };
  } catch (err) {
    return { error: String(err) };
  } finally {
    pc.close();
  }
}"""


@contextlib.asynccontextmanager
async def page_origin() -> AsyncIterator[str]:
    """A static page on its own loopback port: another origin than the API's."""
    app = web.Application()

    async def index(_request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    app.router.add_get("/", index)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        yield str(client.make_url("")).rstrip("/")
    finally:
        await client.close()


async def test_page_on_an_allowed_origin_calls_the_api_and_others_are_blocked():
    async with page_origin() as allowed, page_origin() as other:
        turn = {"secret": "k", "urls": ["turn:127.0.0.1:3478?transport=udp"]}
        sections = {"server": {"cors_origins": [allowed]}, "auth": {"tokens": [TOKEN]}, "turn": turn}
        async with api(**sections) as client:
            base = str(client.make_url("")).rstrip("/")
            async with browser_page() as page:
                await page.goto(allowed + "/")
                result = await page.evaluate(CALL_FROM_PAGE, [base, TOKEN])
                assert "error" not in result, result
                assert result["status"] == 201 and result["location"].startswith("/v1/calls/")
                assert result["link"] and 'rel="ice-server"' in result["link"]  # exposed to the page
                assert result["ice"]["ice_servers"][0]["urls"] == turn["urls"]
                assert result["missing"][0] == 404 and result["missing"][1]["error"]["code"] == "unknown_call"
                assert result["hungUp"] == 200

                await page.goto(other + "/")
                blocked = await page.evaluate(CALL_FROM_PAGE, [base, TOKEN])
                assert "Failed to fetch" in blocked.get("error", ""), blocked
                assert not client.app[REGISTRY].calls  # the preflight stopped it: no call was made


async def test_preflight_and_response_headers():
    origin = "http://127.0.0.1:9"
    async with api(server={"cors_origins": [origin]}, auth={"tokens": [TOKEN]}) as client:
        preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        resp = await client.options("/v1/calls/abc/speak", headers=preflight)
        assert resp.status == 204  # before auth: a preflight carries no token
        assert resp.headers["Access-Control-Allow-Origin"] == origin
        assert "POST" in resp.headers["Access-Control-Allow-Methods"]
        assert "authorization" in resp.headers["Access-Control-Allow-Headers"].lower()
        assert "Access-Control-Allow-Credentials" not in resp.headers

        resp = await client.get("/v1/ice-servers", headers={"Origin": origin})  # no token: 401, with CORS
        assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == origin
        exposed = {h.strip().lower() for h in resp.headers["Access-Control-Expose-Headers"].split(",")}
        assert EXPOSED <= exposed

        stranger = {"Origin": "http://127.0.0.1:10", "Access-Control-Request-Method": "POST"}
        for resp in (
            await client.options("/v1/calls", headers=stranger),
            await client.get("/v1/ice-servers", headers={**stranger, "Authorization": f"Bearer {TOKEN}"}),
        ):
            assert not [h for h in resp.headers if h.lower().startswith("access-control-")], resp.headers

        resp = await client.get("/healthz", headers={"Origin": origin})  # only /v1 is shared
        assert "Access-Control-Allow-Origin" not in resp.headers


async def test_cors_is_off_by_default_and_star_never_allows_credentials():
    async with api() as client:
        resp = await client.get("/v1/ice-servers", headers={"Origin": "http://127.0.0.1:9"})
        assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
    async with api(server={"cors_origins": ["*"]}) as client:
        preflight = {"Origin": "http://a.example", "Access-Control-Request-Method": "DELETE"}
        resp = await client.options("/v1/calls/x", headers=preflight)
        assert resp.status == 204 and resp.headers["Access-Control-Allow-Origin"] == "*"
        assert "Access-Control-Allow-Credentials" not in resp.headers
