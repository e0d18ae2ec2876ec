"""GET /v1/calls/{id} answers what its documented OpenAPI schema (`CallInfo`) says (underrun_frames too)."""

from __future__ import annotations

import jsonschema
import pytest
from api_helpers import api, open_call

from voicertc.webrtc import patch_aioice_loopback


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


async def test_call_info_matches_its_documented_schema():
    async with api() as client:
        spec = await (await client.get("/openapi.json")).json()
        get = spec["paths"]["/v1/calls/{call_id}"]["get"]["responses"]["200"]
        assert get["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/CallInfo"}
        schema = {**spec["components"]["schemas"]["CallInfo"], "components": spec["components"]}
        call_id, _peer = await open_call(client)
        resp = await client.post(f"/v1/calls/{call_id}/speak", json={"text": "Counting frames."})
        assert resp.status == 202
        info = await (await client.get(f"/v1/calls/{call_id}")).json()
        jsonschema.validate(info, schema)
        assert info["id"] == call_id and isinstance(info["underrun_frames"], int)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({k: v for k, v in info.items() if k != "underrun_frames"}, schema)
        await client.delete(f"/v1/calls/{call_id}")
