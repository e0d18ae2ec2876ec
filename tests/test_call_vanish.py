"""A client that vanishes leaves no unretrieved task exception behind (issue 11, finding 10).

When a client disappears without a goodbye, the server's DTLS transport goes down while the data
channel still says "open"; an event sent then failed inside a task aiortc never awaits
("Cannot send encrypted data, not connected"). The suite-wide guard (conftest) fails this test if
that happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc

from aiortc.rtcdtlstransport import State
from call_helpers import PeerClient, fake_config

from voicertc.assemble import create_engine
from voicertc.webrtc import patch_aioice_loopback
from voicertc.webrtc.call import Call


@contextlib.asynccontextmanager
async def connected_call():
    restore = patch_aioice_loopback()
    config = fake_config()
    engine = create_engine(config)
    engine.start()
    call = Call("vanish", engine, config)
    client = PeerClient()
    try:
        await client.accept(await call.answer(await client.offer()))
        await client.wait_open()
        yield call, client
    finally:
        await client.close()
        await call.close("test over")
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        restore()


async def test_events_after_the_transport_died_are_not_sent():
    async with connected_call() as (call, _client):
        assert call.channel is not None and call.channel.readyState == "open"
        dtls = call.channel.transport.transport
        dtls._set_state(State.FAILED)  # what a vanished client leaves: no close_notify, just gone
        assert call.channel.readyState == "open"  # the channel has not noticed yet
        call._emit({"type": "speech.started", "utterance_id": "x", "ttfa_ms": 1.0})
        call._send_direct({"type": "pong", "ts": 1})
        await asyncio.wait_for(call.closed.wait(), 10)  # the failed connection closes the call
        await asyncio.sleep(0.1)
        gc.collect()  # an unretrieved task exception would be logged now (and fail this test)
        assert call.close_reason == "connection failed"
