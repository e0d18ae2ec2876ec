"""The HTTP API through aiohttp's test client: every endpoint, every error, with real aiortc peers."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import pytest
from api_helpers import api, expect_error, open_call
from call_helpers import PeerClient

from signaling.app import ENGINE, http_url
from signaling.routes import REGISTRY
from voicertc.webrtc import patch_aioice_loopback
from voicertc.webrtc.call import Call


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


async def test_create_speak_interrupt_hang_up():
    async with api() as client:
        call_id, peer = await open_call(client)
        resp = await client.post(f"/v1/calls/{call_id}/speak", json={"text": "Hello from the API. " * 20})
        assert resp.status == 202
        utterance_id = (await resp.json())["utterance_id"]
        await peer.wait_event("speech.started", utterance_id=utterance_id)
        resp = await client.post(f"/v1/calls/{call_id}/interrupt")
        assert resp.status == 200
        cut = await resp.json()
        assert cut["utterance_id"] == utterance_id and cut["played_ms"] > 0
        event = await peer.wait_event("speech.interrupted")
        assert event["played_ms"] == cut["played_ms"]
        resp = await client.get(f"/v1/calls/{call_id}")
        assert (await resp.json())["state"] == "connected"
        resp = await client.delete(f"/v1/calls/{call_id}")
        assert resp.status == 200
        await expect_error(await client.delete(f"/v1/calls/{call_id}"), 404, "unknown_call")


async def test_json_offer_and_interrupt_flag():
    async with api() as client:
        call_id, peer = await open_call(client, as_json=True)
        first = await (await client.post(f"/v1/calls/{call_id}/speak", json={"text": "One. " * 40})).json()
        await peer.wait_event("speech.started", utterance_id=first["utterance_id"])
        resp = await client.post(f"/v1/calls/{call_id}/speak", json={"text": "Two.", "interrupt": True})
        second = await resp.json()
        assert (await peer.wait_event("speech.interrupted"))["utterance_id"] == first["utterance_id"]
        assert (await peer.wait_event("speech.done"))["utterance_id"] == second["utterance_id"]


async def test_ndjson_stream_speaks_as_lines_arrive():
    async with api() as client:
        call_id, peer = await open_call(client)

        async def body():
            for word in ["Streamed ", "from ", "a ", "language ", "model."]:
                yield (json.dumps({"text": word}) + "\n").encode()
                await asyncio.sleep(0.05)

        resp = await client.post(
            f"/v1/calls/{call_id}/speak", data=body(), headers={"Content-Type": "application/x-ndjson"}
        )
        assert resp.status == 202
        utterance_id = (await resp.json())["utterance_id"]
        done = await peer.wait_event("speech.done", utterance_id=utterance_id)
        assert done["played_ms"] == pytest.approx(len("Streamed from a language model.") * 65, rel=0.05)


async def test_malformed_ndjson_fails_the_utterance_not_the_call():
    async with api() as client:
        call_id, peer = await open_call(client)
        body = b'{"text": "Fine so far. "}\n{not json\n{"text": "never"}\n'
        resp = await client.post(
            f"/v1/calls/{call_id}/speak", data=body, headers={"Content-Type": "application/x-ndjson"}
        )
        await expect_error(resp, 400, "bad_ndjson")
        assert (await peer.wait_event("error"))["code"] == "bad_ndjson"
        resp = await client.post(f"/v1/calls/{call_id}/speak", json={"text": "Still here."})
        assert resp.status == 202
        await peer.wait_event("speech.done", utterance_id=(await resp.json())["utterance_id"])


async def test_speak_errors():
    async with api(limits={"max_text_chars": 50}) as client:
        call_id, _peer = await open_call(client)
        url = f"/v1/calls/{call_id}/speak"
        await expect_error(await client.post(url, json={"text": "x" * 51}), 413, "text_too_long")
        lines = b"".join(json.dumps({"text": "y" * 20}).encode() + b"\n" for _ in range(3))
        ndjson = {"Content-Type": "application/x-ndjson"}
        await expect_error(await client.post(url, data=lines, headers=ndjson), 413, "text_too_long")
        await expect_error(await client.post(url, json={"text": "  "}), 400, "bad_input")
        await expect_error(await client.post(url, json={"txt": "hi"}), 400, "bad_input")
        await expect_error(await client.post(url, json=["hi"]), 400, "bad_json")
        bad = {"Content-Type": "application/json"}
        await expect_error(await client.post(url, data=b"{", headers=bad), 400, "bad_json")
        await expect_error(
            await client.post(url, json={"text": "hi", "voice": "nobody"}), 400, "unknown_voice"
        )
        await expect_error(
            await client.post(url, json={"text": "hi", "interrupt": "yes"}), 400, "bad_request"
        )
        await expect_error(await client.post(url, data="hi"), 415, "unsupported_media_type")
        await expect_error(
            await client.post("/v1/calls/nope/speak", json={"text": "hi"}), 404, "unknown_call"
        )
        await expect_error(await client.post("/v1/calls/nope/interrupt"), 404, "unknown_call")
        await expect_error(await client.get("/v1/calls/nope/events"), 404, "unknown_call")
        await expect_error(await client.get("/v1/calls/nope"), 404, "unknown_call")


async def test_offer_errors():
    async with api() as client:
        sdp = {"Content-Type": "application/sdp"}
        await expect_error(await client.post("/v1/calls", data="hello", headers=sdp), 400, "bad_sdp")
        garbage = "v=0\r\nm=audio nonsense\r\n"
        await expect_error(await client.post("/v1/calls", data=garbage, headers=sdp), 400, "bad_sdp")
        no_audio = PeerClient(audio=False)
        offer = await no_audio.offer()
        await no_audio.close()
        await expect_error(await client.post("/v1/calls", data=offer, headers=sdp), 400, "no_audio")
        await expect_error(
            await client.post("/v1/calls", data=offer, headers={}), 415, "unsupported_media_type"
        )
        await expect_error(await client.post("/v1/calls", json={"sdp": offer}), 400, "bad_sdp")
        await expect_error(await client.post("/v1/calls", json={"type": "offer", "sdp": 3}), 400, "bad_sdp")
        assert (await (await client.get("/healthz")).json())["active_calls"] == 0


async def test_max_calls_gives_503_with_retry_after():
    async with api(limits={"max_calls": 1}) as client:
        await open_call(client)
        peer = PeerClient()
        client.peers.append(peer)
        resp = await client.post(
            "/v1/calls", data=await peer.offer(), headers={"Content-Type": "application/sdp"}
        )
        await expect_error(resp, 503, "too_many_calls")
        assert int(resp.headers["Retry-After"]) > 0


async def test_trickle_patch():
    async with api() as client:
        call_id, peer = await open_call(client)
        url = f"/v1/calls/{call_id}"
        frag = {"Content-Type": "application/trickle-ice-sdpfrag"}
        ufrag = re.search(r"a=ice-ufrag:(\S+)", peer.pc.localDescription.sdp).group(1)
        tail = "m=audio 9 UDP/TLS/RTP/SAVPF 0\r\na=mid:0\r\n"
        tail += "a=candidate:1 1 udp 2122260223 127.0.0.1 50000 typ host\r\na=end-of-candidates\r\n"
        body = f"a=ice-ufrag:{ufrag}\r\n" + tail
        assert (await client.patch(url, data=body, headers=frag)).status == 204
        new_ufrag = f"a=ice-ufrag:{ufrag}x\r\na=ice-pwd:{'p' * 24}\r\n" + tail
        await expect_error(
            await client.patch(url, data=new_ufrag, headers=frag), 422, "ice_restart_unsupported"
        )
        huge = body + "a=x-padding:" + "z" * 70_000 + "\r\n"
        await expect_error(await client.patch(url, data=huge, headers=frag), 413, "sdp_too_large")
        await expect_error(
            await client.patch(url, data="a=candidate:1 1 udp", headers=frag), 400, "bad_candidate"
        )
        await expect_error(await client.patch(url, data="hello", headers=frag), 400, "bad_sdpfrag")
        restart = {**frag, "If-Match": "*"}
        await expect_error(
            await client.patch(url, data=body, headers=restart), 422, "ice_restart_unsupported"
        )
        await expect_error(await client.patch(url, data=body), 415, "unsupported_media_type")
        await expect_error(await client.patch("/v1/calls/nope", data=body, headers=frag), 404, "unknown_call")


async def test_events_stream_mirrors_the_data_channel():
    async with api() as client:
        call_id, peer = await open_call(client)
        resp = await client.get(f"/v1/calls/{call_id}/events")
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        await client.post(f"/v1/calls/{call_id}/speak", json={"text": "Short one."})
        await peer.wait_event("speech.done")
        await client.delete(f"/v1/calls/{call_id}")
        text = (await asyncio.wait_for(resp.read(), 5)).decode()
        kinds = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("event: ")]
        assert kinds == ["speech.queued", "speech.started", "speech.done", "call.closed"]
        data = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
        assert data[2] == next(e for e in peer.events if e["type"] == "speech.done")
        assert data[0] == next(e for e in peer.events if e["type"] == "speech.queued")


async def test_auth_tokens():
    async with api(auth={"tokens": ["s3cret"]}) as client:
        await expect_error(await client.get("/v1/calls/x"), 401, "unauthorized")
        await expect_error(
            await client.get("/v1/calls/x", headers={"Authorization": "Basic abc"}), 401, "unauthorized"
        )
        wrong = {"Authorization": "Bearer nope"}
        await expect_error(await client.get("/v1/calls/x", headers=wrong), 403, "forbidden")
        right = {"Authorization": "Bearer s3cret"}
        await expect_error(await client.get("/v1/calls/x", headers=right), 404, "unknown_call")
        assert (await client.get("/healthz")).status == 200  # not under /v1


async def test_health_metrics_openapi_page_and_unknown_routes():
    async with api() as client:
        call_id, peer = await open_call(client)
        resp = await client.post(f"/v1/calls/{call_id}/speak", json={"text": "Count me."})
        await peer.wait_event("speech.done")
        await client.post(f"/v1/calls/{call_id}/interrupt")
        health = await (await client.get("/healthz")).json()
        assert health == {"status": "ok", "engine": "fake", "voices": ["tone", "silence"], "active_calls": 1}
        text = await (await client.get("/metrics")).text()
        assert "voicertc_active_calls 1" in text
        assert "voicertc_utterances_total 1" in text
        assert "voicertc_ttfa_seconds_count 1" in text
        assert "voicertc_underrun_frames_total" in text and "voicertc_errors_total" in text
        assert "voicertc_engine_rtf_count 1" in text  # the engine's per-utterance metrics
        assert 'voicertc_engine_stage_seconds_total{stage="synth"}' in text
        assert 'voicertc_engine_stage_seconds_total{stage="ttfa"}' in text
        spec = await (await client.get("/openapi.json")).json()
        assert spec["openapi"].startswith("3.")
        assert {"post"} <= set(spec["paths"]["/v1/calls"]) and "patch" in spec["paths"]["/v1/calls/{call_id}"]
        page = await client.get("/")
        assert page.status == 200 and "<html" in (await page.text()).lower()
        assert (await client.get("/static/app.js")).status == 200
        await expect_error(await client.get("/nothing-here"), 404, "not_found")
        await expect_error(await client.put("/v1/calls"), 405, "method_not_allowed")
        assert resp.status == 202


async def test_a_vanished_browser_is_freed_and_others_keep_speaking():
    async with api() as client:
        gone_id, gone = await open_call(client)
        stay_id, stay = await open_call(client)
        await client.post(f"/v1/calls/{gone_id}/speak", json={"text": "Long. " * 50})
        resp = await client.post(f"/v1/calls/{stay_id}/speak", json={"text": "Still talking here. " * 5})
        utterance_id = (await resp.json())["utterance_id"]
        await gone.wait_event("speech.started")
        await gone.pc.close()
        for _ in range(100):
            if (await client.get(f"/v1/calls/{gone_id}")).status == 404:
                break
            await asyncio.sleep(0.1)
        await expect_error(await client.get(f"/v1/calls/{gone_id}"), 404, "unknown_call")
        done = await stay.wait_event("speech.done", utterance_id=utterance_id, timeout_s=20)
        assert done["played_ms"] > 5000


def test_cli_flags_override_the_config_file(tmp_path):
    from signaling.cli import build_parser, main, resolve_config

    path = tmp_path / "config.toml"
    path.write_text('[server]\nport = 9000\n[engine]\nbackend = "fake"\n')
    args = build_parser().parse_args(["serve", "--config", str(path), "--port", "0", "--host", "0.0.0.0"])
    config = resolve_config(args)
    assert (config.server.host, config.server.port, config.engine.backend) == ("0.0.0.0", 0, "fake")
    args = build_parser().parse_args(
        ["serve", "--config", str(path), "--engine", "cosyvoice2", "--model-dir", "/m"]
    )
    assert resolve_config(args).engine.model_dir == "/m"
    path.write_text("[server]\nport = 70000\n")
    assert main(["serve", "--config", str(path)]) == 2  # names server.port on stderr


async def test_a_stopped_engine_answers_503():
    async with api() as client:
        call_id, _peer = await open_call(client)
        engine = client.server.app[ENGINE]
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        url = f"/v1/calls/{call_id}/speak"
        await expect_error(await client.post(url, json={"text": "Anyone there?"}), 503, "engine_stopped")
        peer = PeerClient()
        client.peers.append(peer)
        sdp = {"Content-Type": "application/sdp"}
        resp = await client.post("/v1/calls", data=await peer.offer(), headers=sdp)
        await expect_error(resp, 503, "engine_stopped")


async def test_a_full_call_queue_answers_429():
    async with api(limits={"max_queued_utterances": 2}) as client:
        call_id, _peer = await open_call(client)
        url = f"/v1/calls/{call_id}/speak"
        for text in ("One. " * 20, "Two."):
            assert (await client.post(url, json={"text": text})).status == 202
        resp = await client.post(url, json={"text": "Three."})
        await expect_error(resp, 429, "too_many_utterances")
        assert "Retry-After" in resp.headers
        assert (await client.post(url, json={"text": "Now.", "interrupt": True})).status == 202


async def test_ndjson_id_is_known_at_once_and_a_hang_up_ends_the_request():
    async with api() as client:
        call_id, peer = await open_call(client)

        async def endless():
            for _ in range(200):
                yield b'{"text": "more "}\n'
                await asyncio.sleep(0.05)

        ndjson = {"Content-Type": "application/x-ndjson"}
        post = asyncio.ensure_future(
            client.post(f"/v1/calls/{call_id}/speak", data=endless(), headers=ndjson)
        )
        queued = await peer.wait_event("speech.queued")  # before the body ends
        assert not post.done()
        await client.delete(f"/v1/calls/{call_id}")
        resp = await asyncio.wait_for(post, 3)  # the stream still had 9 s to go
        assert (await resp.json())["utterance_id"] == queued["utterance_id"]


async def test_ndjson_blank_lines_count_against_the_limit():
    async with api(limits={"max_text_chars": 10}) as client:
        call_id, _peer = await open_call(client)
        body = b"\n" * 2000 + b'{"text": "hi"}\n'
        resp = await client.post(
            f"/v1/calls/{call_id}/speak", data=body, headers={"Content-Type": "application/x-ndjson"}
        )
        await expect_error(resp, 413, "ndjson_too_large")
        no_newline = b'{"text": "' + b"x" * 300_000  # one endless line is bounded too
        resp = await client.post(
            f"/v1/calls/{call_id}/speak", data=no_newline, headers={"Content-Type": "application/x-ndjson"}
        )
        await expect_error(resp, 413, "ndjson_too_large")


async def test_sse_client_that_disconnects_is_unsubscribed():
    async with api() as client:
        call_id, _peer = await open_call(client)
        call = client.server.app[REGISTRY].calls[call_id]
        resp = await client.get(f"/v1/calls/{call_id}/events")
        assert len(call._subscribers) == 1
        resp.close()
        for _ in range(50):
            await client.post(f"/v1/calls/{call_id}/speak", json={"text": "Tick."})
            if not call._subscribers:
                break
            await asyncio.sleep(0.1)
        assert call._subscribers == []


async def test_big_offers_missing_page_and_http_errors_in_metrics(tmp_path):
    (tmp_path / "app.js").write_text("// no index.html here")
    async with api(server={"static_dir": str(tmp_path)}) as client:
        sdp = {"Content-Type": "application/sdp"}
        huge = "v=0\r\n" + "a=x:" + "y" * 70_000 + "\r\n"
        await expect_error(await client.post("/v1/calls", data=huge, headers=sdp), 413, "sdp_too_large")
        await expect_error(await client.get("/"), 404, "not_found")
        await expect_error(await client.get("/v1/calls/nope"), 404, "unknown_call")
        text = await (await client.get("/metrics")).text()
        assert 'voicertc_http_errors_total{status="404"} 2' in text
        assert 'voicertc_http_errors_total{status="413"} 1' in text


async def test_a_call_that_fails_while_answered_is_not_kept(monkeypatch):
    answer = Call.answer

    async def answer_then_fail(self, offer_sdp):
        sdp = await answer(self, offer_sdp)
        await self.close("connection failed")  # as aiortc's state change would, mid-answer
        return sdp

    monkeypatch.setattr(Call, "answer", answer_then_fail)
    async with api() as client:
        peer = PeerClient()
        client.peers.append(peer)
        sdp = {"Content-Type": "application/sdp"}
        resp = await client.post("/v1/calls", data=await peer.offer(), headers=sdp)
        await expect_error(resp, 409, "call_closed")
        assert client.server.app[REGISTRY].calls == {}


async def test_a_plain_server_keeps_no_queue_of_answered_calls():
    async with api() as client:
        call_id, _peer = await open_call(client)
        registry = client.server.app[REGISTRY]
        assert not registry.queue_new_calls and len(registry._new_calls) == 0
        await client.delete(f"/v1/calls/{call_id}")


def test_cli_start_errors_name_the_cause(tmp_path, capsys):
    from signaling.cli import main

    path = tmp_path / "config.toml"
    path.write_text(f'[engine]\nbackend = "fake"\n[server]\nstatic_dir = "{tmp_path / "nope"}"\n')
    assert main(["serve", "--config", str(path)]) == 2
    assert "server.static_dir" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path.write_text('[engine]\nbackend = "fake"\n')
        assert main(["serve", "--config", str(path), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "server.port" in err and "in use" in err and "Traceback" not in err
    assert http_url("::", 8080) == "http://[::]:8080" and http_url("0.0.0.0", 1) == "http://0.0.0.0:1"
