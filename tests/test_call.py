"""Call: a real aiortc peer on loopback hears the FakeEngine's tone; order, interrupt, liveness, cleanup."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from call_helpers import PeerClient, fake_config, rms

from voicertc.assemble import create_engine
from voicertc.config import LimitsConfig
from voicertc.errors import InputError, UnknownVoiceError
from voicertc.webrtc import patch_aioice_loopback
from voicertc.webrtc.call import Call, CallClosedError
from voicertc.webrtc.speech import QueueFullError, SpeechQueue


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


@contextlib.asynccontextmanager
async def call_pair(mic: bool = False, **sections):
    config = fake_config(**sections)
    engine = create_engine(config)
    engine.start()
    call = Call("c1", engine, config)
    client = PeerClient(mic=mic)
    try:
        answer = await call.answer(await client.offer())
        await client.accept(answer)
        await client.wait_open()
        yield call, client, engine
    finally:
        await client.close()
        await call.close("test over")
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)


async def test_speak_plays_audio_then_done():
    async with call_pair() as (call, client, _engine):
        handle = call.speak("Hello there, this is a test.")
        started = await client.wait_event("speech.started", utterance_id=handle.utterance_id)
        done = await handle.done()
        assert done["type"] == "speech.done"
        assert started["ttfa_ms"] > 0
        # 28 characters at the fake's 65 ms per character
        assert done["played_ms"] == pytest.approx(28 * 65, rel=0.05)
        await asyncio.sleep(0.3)  # frames in flight
        assert rms(client.audio()) > 0.05
        assert (await client.wait_event("speech.done"))["utterance_id"] == handle.utterance_id


async def test_utterances_of_one_call_play_in_order():
    async with call_pair() as (call, client, _engine):
        first = call.speak("First sentence here.")
        second = call.speak("Second one.")
        await second.done()
        assert first.finished
        await client.wait_event("speech.done", utterance_id=second.utterance_id)
        kinds = [(e["type"], e["utterance_id"]) for e in client.events if e["type"].startswith("speech.")]
        assert kinds == [
            ("speech.queued", first.utterance_id),
            ("speech.queued", second.utterance_id),
            ("speech.started", first.utterance_id),
            ("speech.done", first.utterance_id),
            ("speech.started", second.utterance_id),
            ("speech.done", second.utterance_id),
        ]
        # the second one's TTFA counts from the end of the first one's playout, not from its request
        first_ms = (await first.done())["played_ms"]
        second_ttfa = next(
            e
            for e in client.events
            if e["type"] == "speech.started" and e["utterance_id"] == second.utterance_id
        )["ttfa_ms"]
        assert second_ttfa < first_ms / 3


async def test_streamed_deltas_speak_one_utterance():
    async def deltas():
        for word in ["Streaming ", "text ", "from ", "an ", "agent."]:
            yield word
            await asyncio.sleep(0.02)

    async with call_pair() as (call, _client, _engine):
        handle = call.speak(deltas())
        done = await handle.done()
        assert done["type"] == "speech.done"
        assert done["played_ms"] == pytest.approx(len("Streaming text from an agent.") * 65, rel=0.05)


async def test_interrupt_stops_audio_and_drops_the_queue():
    async with call_pair() as (call, client, _engine):
        long = call.speak("This is a long utterance. " * 20)
        queued = call.speak("Never heard.")
        await client.wait_event("speech.started", utterance_id=long.utterance_id)
        await asyncio.sleep(0.5)
        utterance_id, played_ms = call.interrupt()
        assert utterance_id == long.utterance_id
        assert 300 < played_ms < 3000
        cut = await long.done()
        heard = cut.pop("heard_text")
        assert cut == {
            "type": "speech.interrupted",
            "utterance_id": long.utterance_id,
            "played_ms": round(played_ms, 1),
        }
        # what was heard: the text of the chunks that had started playing, a prefix of what was said
        assert heard and ("This is a long utterance. " * 20).startswith(heard)
        assert (await queued.done())["played_ms"] == 0.0
        await asyncio.sleep(0.4)  # the fade and frames in flight
        heard = len(client.pcm)
        await asyncio.sleep(0.4)
        assert rms(client.audio()[heard * 960 :]) < 1e-3
        assert call.speech.pending == 0


async def test_data_channel_speak_interrupt_and_bad_messages():
    async with call_pair() as (call, client, _engine):
        client.send({"type": "speak", "text": "Hello from the data channel. " * 10})
        queued = await client.wait_event("speech.queued")
        await client.wait_event("speech.started", utterance_id=queued["utterance_id"])
        client.send({"type": "interrupt"})
        cut = await client.wait_event("speech.interrupted")
        assert cut["utterance_id"] == queued["utterance_id"]
        client.channel.send("not json")
        assert (await client.wait_event("error"))["code"] == "bad_message"
        client.send({"type": "ping", "ts": 1})
        assert (await client.wait_event("pong"))["ts"] == 1
        assert not call.closed.is_set()


@pytest.mark.expected_errors("fake engine failure")
async def test_engine_failure_is_an_error_event_and_the_call_stays_up():
    async with call_pair(fake={"fail_after_chunks": 1}) as (call, client, _engine):
        handle = call.speak("This will fail after one chunk of audio, for sure. " * 3)
        event = await handle.done()
        assert event["type"] == "error" and event["code"] == "synthesis_error"
        assert (await client.wait_event("error"))["utterance_id"] == handle.utterance_id
        assert not call.closed.is_set()


async def test_a_peer_that_vanishes_is_freed():
    async with call_pair() as (call, client, engine):
        call.speak("Talking to nobody for a while. " * 20)
        await client.wait_event("speech.started")
        await client.pc.close()  # DTLS close: the server notices
        await asyncio.wait_for(call.closed.wait(), 10)
        assert call.speech.pending == 0
        assert call.ring.queued_samples == 0
        await asyncio.sleep(0.3)
        assert engine._open_count == 0


async def test_keepalive_timeout_closes_a_silent_data_channel():
    async with call_pair(webrtc={"keepalive_timeout_s": 1.0}) as (call, client, _engine):
        client.send({"type": "ping"})
        await client.wait_event("pong")
        await asyncio.wait_for(call.closed.wait(), 5)
        assert call.close_reason == "keepalive timeout"


async def test_a_call_that_never_connects_is_closed():
    config = fake_config(webrtc={"connect_timeout_s": 1.0})
    engine = create_engine(config)
    call = Call("c2", engine, config)
    client = PeerClient()
    try:
        await call.answer(await client.offer())  # the client never applies the answer
        await asyncio.wait_for(call.closed.wait(), 5)
        assert call.close_reason == "connect timeout"
        with pytest.raises(CallClosedError):
            call.speak("Too late.")
    finally:
        await client.close()
        await call.close()


async def test_an_engine_that_stops_fails_the_playing_and_the_queued_utterances():
    async with call_pair() as (call, client, engine):
        playing = call.speak("A long utterance the engine will not finish. " * 20)
        queued = call.speak("Queued behind it.")
        await client.wait_event("speech.started", utterance_id=playing.utterance_id)
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        for handle in (playing, queued):
            event = await asyncio.wait_for(handle.done(), 5)
            assert event["type"] == "error" and event["code"] == "engine_stopped"
        assert call.speech.pending == 0


async def test_a_bad_speak_with_interrupt_leaves_the_playing_utterance_alone():
    async with call_pair() as (call, client, _engine):
        playing = call.speak("Keep talking through the bad requests. " * 10)
        await client.wait_event("speech.started", utterance_id=playing.utterance_id)
        with pytest.raises(InputError):
            call.speak("   ", interrupt=True)
        with pytest.raises(UnknownVoiceError):
            call.speak("Fine text.", voice="nobody", interrupt=True)
        client.send({"type": "speak", "text": "Hi.", "voice": "nobody", "interrupt": True})
        assert (await client.wait_event("error"))["code"] == "unknown_voice"
        assert not playing.finished and call.interrupts == 0


@pytest.mark.parametrize(
    ("voice", "code"),
    [("nobody", "unknown_voice"), (7, "bad_request"), ("", "bad_request"), (["a"], "bad_request")],
)
async def test_the_data_channel_refuses_a_bad_voice_like_http(voice, code):
    async with call_pair() as (call, client, engine):
        client.send({"type": "speak", "text": "Hi there.", "voice": voice})
        error = await client.wait_event("error")
        assert error["code"] == code and "voice" in error["message"]
        assert call.speech.pending == 0 and call.utterances == 0 and engine.open_count == 0
        client.events.clear()
        client.send({"type": "speak", "text": "Hi there.", "interrupt": "yes"})
        assert (await client.wait_event("error"))["code"] == "bad_request"
        assert call.speech.pending == 0


async def test_a_call_queues_at_most_max_queued_utterances():
    async with call_pair(limits={"max_queued_utterances": 2}) as (call, client, _engine):
        call.speak("One. " * 20)
        call.speak("Two.")
        with pytest.raises(QueueFullError):
            call.speak("Three.")
        client.send({"type": "speak", "text": "Four."})
        assert (await client.wait_event("error"))["code"] == "too_many_utterances"
        call.speak("Five, after the interrupt.", interrupt=True)  # an interrupt makes room


async def test_a_text_stream_that_goes_silent_fails_and_frees_the_queue():
    async def stalls():
        yield "Some text and then "
        await asyncio.Event().wait()  # an agent that never finishes its stream
        yield "never"

    async with call_pair(limits={"text_idle_timeout_s": 0.3}) as (call, _client, _engine):
        stalled = call.speak(stalls())
        after = call.speak("Spoken once the stalled one gave up.")
        event = await asyncio.wait_for(stalled.done(), 5)
        assert event["type"] == "error" and event["code"] == "text_idle_timeout"
        assert (await asyncio.wait_for(after.done(), 10))["type"] == "speech.done"


async def test_with_listening_off_a_sendrecv_offer_is_answered_sendonly_and_its_mic_is_not_buffered():
    async with call_pair(mic=True, listen={"enabled": False}) as (call, client, _engine):
        audio_section = call.pc.localDescription.sdp.split("m=audio", 1)[1].split("m=", 1)[0]
        assert "a=sendonly" in audio_section
        handle = call.speak("Heard while the browser's mic is on.")
        assert (await handle.done())["type"] == "speech.done"
        await asyncio.sleep(0.3)
        assert rms(client.audio()) > 0.05
        for transceiver in call.pc.getTransceivers():
            track = transceiver.receiver.track
            assert track is None or track._queue.qsize() == 0  # nothing decoded from the peer
        assert call.listener is None


async def test_with_listening_on_a_sendrecv_offer_is_answered_sendrecv_and_its_mic_is_drained():
    async with call_pair(mic=True, listen={"transcribe": False}) as (call, client, _engine):
        audio_section = call.pc.localDescription.sdp.split("m=audio", 1)[1].split("m=", 1)[0]
        assert "a=sendrecv" in audio_section
        handle = call.speak("Heard while the browser's mic is on.")
        assert (await handle.done())["type"] == "speech.done"
        assert call.listener is not None and call.listener.frames_received > 10
        for transceiver in call.pc.getTransceivers():
            track = transceiver.receiver.track
            assert track is None or track._queue.qsize() < 5  # read as it arrives, never piling up


async def test_a_slow_event_subscriber_is_dropped_not_buffered():
    async with call_pair() as (call, _client, _engine):
        slow = call.subscribe(max_events=2)
        fast = call.subscribe()
        for i in range(5):
            call._emit({"type": "speech.queued", "utterance_id": str(i)})
        got = [slow.get_nowait() for _ in range(slow.qsize())]
        assert [e and e["utterance_id"] for e in got] == ["0", "1", None]
        assert call.overflowed(slow) and not call.overflowed(fast)
        assert fast.qsize() == 5


class RecordingEngine:
    """Just enough of the Engine protocol for SpeechQueue: records what it is asked."""

    running = ready = True
    not_ready_reason = ""
    open_count, max_utterances = 0, 16

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def open_utterance(self, voice, sink, on_event, utterance_id=None):
        self.calls.append(("open", utterance_id))
        return utterance_id

    def push_text(self, utterance_id, text, end=False):
        self.calls.append(("push", text))
        if end:
            self.calls.append(("end", utterance_id))

    def end_input(self, utterance_id):
        self.calls.append(("end", utterance_id))

    def cancel(self, utterance_id):
        self.calls.append(("cancel", utterance_id))


async def test_silent_and_terminal_utterances_emit_no_speech_started():
    events: list[dict] = []
    queue = SpeechQueue(RecordingEngine(), None, events.append, limits=LimitsConfig(), call_id="t")
    silent = queue.speak("...")
    queue.playout_done(silent.utterance_id, 0.0)  # its end mark played without any audio
    assert [e["type"] for e in events] == ["speech.queued", "speech.done"]
    failed = queue.speak("This one fails.")
    queue.fail(failed, "synthesis_error", "boom")
    events.clear()
    queue.playout_started(failed.utterance_id)  # its partial audio still plays out
    queue.playout_done(failed.utterance_id, 120.0)
    assert events == []
    assert (await failed.done())["code"] == "synthesis_error"
