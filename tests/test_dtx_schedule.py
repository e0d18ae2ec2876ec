"""`webrtc.dtx`: the per-frame DTX decision (libopus's hangover and refresh), the DTX packet, and the
answer's `usedtx=1` on a real aiortc answer."""

from __future__ import annotations

import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import AudioStreamTrack
from hypothesis import given
from hypothesis import strategies as st

from voicertc.webrtc.dtx import DtxSchedule, FrameAction, ask_for_dtx, dtx_packet
from voicertc.webrtc.opus_send import silence_payload

S, D, K = FrameAction.SEND, FrameAction.DTX, FrameAction.SKIP


def test_a_silence_is_sent_for_the_hangover_then_one_dtx_packet_per_refresh():
    schedule = DtxSchedule(hangover_frames=3, refresh_frames=4)
    actions = [schedule.action(silent) for silent in [False] + [True] * 12 + [False, True]]
    assert actions == [S, S, S, S, D, K, K, K, D, K, K, K, D, S, S]


@given(st.lists(st.booleans(), max_size=200), st.integers(0, 12), st.integers(1, 25))
def test_every_frame_of_sound_is_sent_and_dtx_packets_are_refresh_frames_apart(silences, hangover, refresh):
    schedule = DtxSchedule(hangover_frames=hangover, refresh_frames=refresh)
    last_dtx: int | None = None
    for index, silent in enumerate(silences):
        action = schedule.action(silent)
        if not silent:
            assert action is S
            last_dtx = None
        elif action is D:
            assert last_dtx is None or index - last_dtx == refresh
            last_dtx = index
        elif action is K:
            assert last_dtx is not None and index - last_dtx < refresh


def test_skipping_jumps_to_the_next_dtx_packet_and_never_past_it():
    schedule = DtxSchedule(hangover_frames=2, refresh_frames=5)
    assert [schedule.action(True) for _ in range(3)] == [S, S, D]
    assert schedule.in_dtx and schedule.frames_until_dtx() == 5
    schedule.skip(4)
    assert schedule.action(True) is D
    with pytest.raises(ValueError, match="would pass a DTX packet"):
        schedule.skip(5)


def test_the_dtx_packet_is_the_silence_packets_toc_byte_alone():
    payload = silence_payload()
    assert payload is not None and len(payload) > 2
    packet = dtx_packet(payload)
    assert len(packet) == 1 and packet[0] >> 2 == payload[0] >> 2 and packet[0] & 3 == 0
    with pytest.raises(ValueError):
        dtx_packet(b"")


async def test_the_answer_asks_for_usedtx_on_opus_only_and_the_caller_applies_it():
    caller, server = RTCPeerConnection(RTCConfiguration([])), RTCPeerConnection(RTCConfiguration([]))
    try:
        caller.addTrack(AudioStreamTrack())
        await caller.setLocalDescription(await caller.createOffer())
        await server.setRemoteDescription(caller.localDescription)
        server.addTrack(AudioStreamTrack())
        await server.setLocalDescription(await server.createAnswer())
        sdp = server.localDescription.sdp
        asked = ask_for_dtx(sdp)
        await caller.setRemoteDescription(RTCSessionDescription(sdp=asked, type="answer"))
    finally:
        await caller.close()
        await server.close()
    opus = next(line.split()[0][len("a=rtpmap:") :] for line in sdp.split("\r\n") if "opus/48000" in line)
    fmtp = [line for line in asked.split("\r\n") if line.startswith(f"a=fmtp:{opus} ")]
    assert len(fmtp) == 1 and fmtp[0].endswith("usedtx=1"), fmtp
    assert asked.count("usedtx=1") == 1
    assert asked.replace(";usedtx=1", "").replace(f"\r\na=fmtp:{opus} usedtx=1", "") == sdp  # nothing else
    assert ask_for_dtx(asked) == asked  # already asked: unchanged
    video_only = "v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\na=rtpmap:96 VP8/90000\r\n"
    assert ask_for_dtx(video_only) == video_only
