"""Outgoing Opus: frames in the encoder's own format skip aiortc's resampler and come out as the same
packets with the same timestamps; any other frame (mono, 10 ms) takes aiortc's path for good."""

from __future__ import annotations

import fractions

import numpy as np
from aiortc.codecs import opus
from av import AudioFrame

from voicertc.webrtc import opus_send

TIME_BASE = fractions.Fraction(1, 48000)


def frames(n: int, samples: int, layout: str, seed: int = 0) -> list[AudioFrame]:
    rng = np.random.default_rng(seed)
    channels = 2 if layout == "stereo" else 1
    out = []
    t = np.arange(n * samples) / 48000
    tone = (8000 * np.sin(2 * np.pi * 220 * t) + rng.normal(0, 300, t.size)).astype(np.int16)
    for i in range(n):
        pcm = np.repeat(tone[i * samples : (i + 1) * samples], channels)
        frame = AudioFrame.from_ndarray(pcm[None, :], format="s16", layout=layout)
        frame.sample_rate, frame.pts, frame.time_base = 48000, i * samples, TIME_BASE
        out.append(frame)
    return out


def encoded(encode, batch: list[AudioFrame]) -> list[tuple[list[bytes], int | None]]:
    encoder = opus.OpusEncoder()
    return [encode(encoder, frame) for frame in batch]


def test_track_frames_encode_to_the_same_packets_without_the_resampler():
    batch = frames(50, 960, "stereo")
    ours = encoded(opus_send.encode, batch)
    theirs = encoded(opus_send.AIORTC_ENCODE, batch)
    assert ours == theirs
    assert sum(len(payloads) for payloads, _ in ours) >= 49 and ours[-1][1] is not None


def test_other_frames_take_aiortcs_path_for_good():
    for samples, layout in ((480, "stereo"), (960, "mono")):
        batch = frames(40, samples, layout)
        assert encoded(opus_send.encode, batch) == encoded(opus_send.AIORTC_ENCODE, batch)
    other_clock = frames(10, 960, "stereo")
    for i, frame in enumerate(other_clock):
        frame.pts, frame.time_base = 2 * 960 * i, fractions.Fraction(1, 96000)  # the resampler re-times it
    assert encoded(opus_send.encode, other_clock) == encoded(opus_send.AIORTC_ENCODE, other_clock)
    encoder = opus.OpusEncoder()
    opus_send.encode(encoder, frames(1, 480, "stereo")[0])  # half a frame now buffered in the resampler
    assert encoder.voicertc_resampling
    assert opus_send.encode(encoder, frames(2, 960, "stereo")[1])[0]  # still resampled: nothing lost


def test_install_is_idempotent():
    opus_send.install()
    opus_send.install()
    assert opus.OpusEncoder.encode is opus_send.encode


def speech_silence_speech() -> list[AudioFrame]:
    speech = frames(40, 960, "stereo", seed=3)
    silent = []
    for i in range(30):
        frame = AudioFrame.from_ndarray(np.zeros((1, 1920), np.int16), format="s16", layout="stereo")
        frame.sample_rate, frame.pts, frame.time_base = 48000, (20 + i) * 960, TIME_BASE
        silent.append(frame)
    resumed = speech[20:]
    for i, frame in enumerate(resumed):
        frame.pts = (50 + i) * 960
    return speech[:20] + silent + resumed


def decode(stream: list[tuple[list[bytes], int | None]]) -> np.ndarray:
    from aiortc.codecs.opus import OpusDecoder
    from aiortc.jitterbuffer import JitterFrame

    decoder = OpusDecoder()
    out = [
        decoder.decode(JitterFrame(data=payloads[0], timestamp=ts))[0].to_ndarray() for payloads, ts in stream
    ]
    return np.concatenate([pcm.reshape(-1) for pcm in out]).astype(np.float64)


def test_the_encoder_settles_on_one_silence_packet():
    payload = opus_send.silence_payload()
    assert payload is not None and len(payload) <= 8
    stream = encoded(opus_send.encode, speech_silence_speech())
    assert [payloads[0] for payloads, _ in stream[25:50]] == [payload] * 25  # within 5 frames of the speech


def test_silence_sent_as_packets_keeps_the_bytes_the_timeline_and_the_audio():
    opus_send.install()
    payload = opus_send.silence_payload()
    assert payload is not None
    batch = speech_silence_speech()
    encoder = opus.OpusEncoder()
    mixed = []
    for i, frame in enumerate(batch):
        if 25 <= i < 50:  # what SpeechTrack does after 5 silent frames
            mixed.append(encoder.pack(opus_send.silence_packet(payload, frame.pts)))
        else:
            mixed.append(opus_send.encode(encoder, frame))
    every = encoded(opus_send.encode, batch)
    assert [ts for _, ts in mixed] == [ts for _, ts in every] == [i * 960 for i in range(70)]
    assert mixed[:50] == every[:50]
    # both streams decode to the resumed speech with the same fidelity (the codec's delay aligned)
    source = np.concatenate([frame.to_ndarray().reshape(-1) for frame in batch]).astype(np.float64)
    ours, reference = decode(mixed), decode(every)
    start = 52 * 1920

    def snr_db(decoded: np.ndarray, delay: int) -> float:
        sent = source[start : source.size - delay]
        return float(10 * np.log10(np.sum(sent**2) / np.sum((decoded[start + delay :] - sent) ** 2)))

    delay = max(range(0, 1400, 2), key=lambda d: snr_db(reference, d))
    assert snr_db(reference, delay) > 15.0
    assert abs(snr_db(ours, delay) - snr_db(reference, delay)) < 0.5


def test_install_patches_pack_too():
    opus_send.install()
    assert opus.OpusEncoder.pack is opus_send.pack


async def test_the_call_sends_silence_packets_only_when_its_answer_sends_opus():
    from aiortc import RTCPeerConnection, RTCRtpSender

    from voicertc.webrtc.call import sends_opus
    from voicertc.webrtc.loopback import patch_aioice_loopback

    restore = patch_aioice_loopback()
    try:
        for codec, expected in (("opus", True), ("PCMU", False)):
            offerer, answerer = RTCPeerConnection(), RTCPeerConnection()
            transceiver = offerer.addTransceiver("audio", direction="recvonly")
            capabilities = RTCRtpSender.getCapabilities("audio").codecs
            transceiver.setCodecPreferences([c for c in capabilities if c.name == codec])
            await offerer.setLocalDescription(await offerer.createOffer())
            await answerer.setRemoteDescription(offerer.localDescription)
            answerer.getTransceivers()[0].direction = "sendonly"
            await answerer.setLocalDescription(await answerer.createAnswer())
            assert sends_opus(answerer.localDescription.sdp) is expected, codec
            await offerer.close()
            await answerer.close()
    finally:
        restore()
