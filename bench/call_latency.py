"""Speak -> first RTP packet of the utterance's audio leaving the server, bundled Piper voice.

    .venv/bin/python -m bench.call_latency [--runs 25]

The real server (`VoiceServer`: aiohttp app, Piper engine thread, aiortc) runs in this process on
127.0.0.1, on uvloop when installed (as `voicertc serve` does); a Python aiortc peer (bench/peer.py)
calls it over the HTTP API and drains the audio it receives. Each run: idle a random 0.2-0.5 s (so
the request lands at a random phase of the 20 ms frame clock), `POST /v1/calls/{id}/speak`, wait for
the first RTP packet of that utterance, let it play 0.3 s, interrupt over HTTP.

Measurement points, all on this process's `time.monotonic()`, t0 just before the HTTP request:
- `http_202_ms`: the 202 answer is back at the client.
- `first_frame_ms`: SpeechTrack.recv() returned the first frame holding the utterance's samples (the
  track's "started" playout event, which fires inside that recv()).
- `first_rtp_ms`: that frame's RTP packet was handed to the DTLS transport and sent: the sender's
  `transport._send_rtp` (SRTP protect + UDP sendto) returned. The packet is matched by RTP timestamp
  (RTP ts - frame pts is constant: the sender recv()s, encodes and sends one packet per frame in
  sequence; checked on every packet, see `rtp_ts_mismatches`).
- `encode_ms`: first_rtp - first_frame (aiortc's Opus encode in its executor + packetize + send).
- `audible_rtp_ms`: the RTP packet of the first frame with a sample above 0.01 (-40 dBFS; Piper's
  output starts quietly), the server-side counterpart of bench/browser_latency.py's threshold.
- `server_ttfa_ms`: the server's own `speech.started` ttfa (from when the utterance could play -> first
  frame).
Prints a table; writes bench/results/call_latency_trim<ms>.json (`--trim-ms 0` sends the voice's
leading near-silence, as before the trim existed).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np

from bench.peer import HttpPeer
from bench.report import summary, table, write_json
from signaling.embed import VoiceServer
from voicertc.config import config_from_dict
from voicertc.webrtc.call import Call
from voicertc.webrtc.track import PlayoutEvent

TEXTS = {
    "short (4 words)": "Hello, how are you?",
    "medium (10 words)": "I can help you book a table for dinner tonight.",
}
PLAY_S = 0.3
AUDIBLE = 0.01  # a frame with a sample above this (-40 dBFS) is audible, as in bench/browser_latency.py
RTP_CLOCK_MASK = 0xFFFFFFFF


def _is_rtcp(packet: bytes) -> bool:
    return len(packet) >= 2 and 192 <= packet[1] <= 223


class SendProbe:
    """Watches one server call: the frames that start an utterance and the RTP packets that carry them.

    Two marks per utterance: "first" (the frame holding its first samples: the track's "started"
    playout event fires inside that recv()) and "audible" (the first frame with a sample above
    AUDIBLE, the browser bench's threshold). Hooks (instance attributes, the package is untouched):
    the track's `on_playout` callback, the track's `recv` (times each frame), and the sender's DTLS
    `_send_rtp` (times each packet; checks RTP ts - pts is constant). Owned by the event loop.
    """

    def __init__(self, call: Call) -> None:
        self.track = call.track
        self.rtp_ts_offset: int | None = None  # RTP ts - frame pts, from the first hooked frame
        self.rtp_packets = 0
        self.rtp_ts_mismatches = 0
        self._last_pts = -1
        self._armed = False
        self._started_now = False  # the "started" event fired in the recv() under way
        self._marks: dict[str, tuple[int, float]] = {}  # mark -> (pts, time recv() returned it)
        self._sent: dict[str, tuple[float, float]] = {}  # mark -> (recv time, RTP send time)
        self._all_sent: asyncio.Future[None] | None = None
        self._hook_playout()
        self._hook_recv()
        sender = next(s for s in call.pc.getSenders() if s.track is call.track)
        self._hook_send(sender.transport)

    def _hook_playout(self) -> None:
        original = self.track.on_playout

        def on_playout(event: PlayoutEvent) -> None:
            if event.kind == "started":
                self._started_now = True
            if original is not None:
                original(event)

        self.track.on_playout = on_playout

    def _hook_recv(self) -> None:
        original: Callable[[], Awaitable[Any]] = self.track.recv

        async def recv() -> Any:
            self._started_now = False
            frame = await original()
            now = time.monotonic()
            self._last_pts = int(frame.pts)
            if self._armed:
                self._mark_frame(frame, now)
            return frame

        self.track.recv = recv  # type: ignore[method-assign]

    def _mark_frame(self, frame: Any, now: float) -> None:
        if self._started_now and "first" not in self._marks:
            self._marks["first"] = (self._last_pts, now)
        if "first" in self._marks and "audible" not in self._marks:
            if np.abs(frame.to_ndarray()).max() > AUDIBLE * 32768:
                self._marks["audible"] = (self._last_pts, now)

    def _hook_send(self, transport: Any) -> None:
        original = transport._send_rtp

        async def send_rtp(packet: bytes) -> None:
            await original(packet)
            if not _is_rtcp(packet):
                self._on_rtp(int.from_bytes(packet[4:8], "big"), time.monotonic())

        transport._send_rtp = send_rtp

    def _on_rtp(self, rtp_ts: int, sent_s: float) -> None:
        if self.rtp_ts_offset is None:
            if self._last_pts < 0:
                return  # its frame left recv() before the hooks were in place
            self.rtp_ts_offset = rtp_ts - self._last_pts
        pts = (rtp_ts - self.rtp_ts_offset) & RTP_CLOCK_MASK
        self.rtp_packets += 1
        if pts != self._last_pts:
            self.rtp_ts_mismatches += 1
        for mark, (mark_pts, recv_s) in self._marks.items():
            if mark not in self._sent and pts >= mark_pts:
                self._sent[mark] = (recv_s, sent_s)
        if len(self._sent) == 2 and self._all_sent is not None and not self._all_sent.done():
            self._armed = False
            self._all_sent.set_result(None)

    async def next_utterance(self, timeout_s: float = 10.0) -> dict[str, tuple[float, float]]:
        """Arm, and after the caller's speak: {mark: (frame recv time, its RTP send time)}."""
        self._marks, self._sent = {}, {}
        self._all_sent = asyncio.get_running_loop().create_future()
        self._armed = True
        await asyncio.wait_for(self._all_sent, timeout_s)
        return dict(self._sent)


async def one_run(peer: HttpPeer, probe: SendProbe, text: str) -> dict[str, float]:
    await asyncio.sleep(random.uniform(0.2, 0.5))
    sent = asyncio.ensure_future(probe.next_utterance())
    await asyncio.sleep(0)  # armed
    t0 = time.monotonic()
    utterance_id = await peer.speak(text)
    t_202 = time.monotonic()
    marks = await sent
    (frame_s, rtp_s), (_, audible_rtp_s) = marks["first"], marks["audible"]
    started = await peer.wait_event("speech.started", utterance_id)
    await asyncio.sleep(PLAY_S)
    await peer.interrupt()
    await peer.wait_event("speech.interrupted", utterance_id)
    return {
        "http_202_ms": 1000 * (t_202 - t0),
        "first_frame_ms": 1000 * (frame_s - t0),
        "first_rtp_ms": 1000 * (rtp_s - t0),
        "encode_ms": 1000 * (rtp_s - frame_s),
        "audible_rtp_ms": 1000 * (audible_rtp_s - t0),
        "server_ttfa_ms": float(started["ttfa_ms"]),
    }


def _row(label: str, runs: int, stats: dict[str, dict[str, float]]) -> dict[str, object]:
    row: dict[str, object] = {"sentence": label, "runs": runs}
    for key, name in (
        ("first_rtp_ms", "RTP"),
        ("first_frame_ms", "frame"),
        ("encode_ms", "encode"),
        ("audible_rtp_ms", "audible RTP"),
    ):
        row[f"{name} p50 ms"] = stats[key]["p50"]
        row[f"{name} p95 ms"] = stats[key]["p95"]
    row["HTTP 202 p50 ms"] = stats["http_202_ms"]["p50"]
    return row


async def main(runs: int, trim_ms: int) -> None:
    webrtc = {"loopback_only": True, "trim_leading_silence_ms": trim_ms}
    config = config_from_dict({"server": {"port": 0}, "webrtc": webrtc, "engine": {"backend": "piper"}})
    server = VoiceServer(config)
    url = await server.start()
    async with aiohttp.ClientSession() as http:
        peer = HttpPeer(http, url)
        try:
            await peer.connect()
            agent_call = await server.next_call(timeout_s=10)
            probe = SendProbe(agent_call._call)  # bench reach-in: the package's Call behind the agent API
            await one_run(peer, probe, "Warm up.")
            rows: list[dict[str, object]] = []
            record: dict[str, object] = {}
            for label, text in TEXTS.items():
                samples = [await one_run(peer, probe, text) for _ in range(runs)]
                stats = {k: summary([s[k] for s in samples]) for k in samples[0]}
                record[label] = {"text": text, **stats}
                rows.append(_row(label, runs, stats))
            print(table(rows, list(rows[0])))  # noqa: T201 - benchmark output
            checks = {"rtp_packets": probe.rtp_packets, "rtp_ts_mismatches": probe.rtp_ts_mismatches}
            print("RTP packets checked:", checks)  # noqa: T201
            record = {"runs": runs, "trim_ms": trim_ms, "loop": _loop_name(), **checks, "results": record}
            path = write_json(f"call_latency_trim{trim_ms}", record)
            print("wrote", path)  # noqa: T201
        finally:
            await peer.close()
            await server.stop()


def _loop_name() -> str:
    return type(asyncio.get_running_loop()).__module__


def _run(runs: int, trim_ms: int) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(runs, trim_ms))
    else:
        uvloop.run(main(runs, trim_ms))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--trim-ms", type=int, default=100, help="webrtc.trim_leading_silence_ms (0 = off)")
    args = parser.parse_args()
    _run(args.runs, args.trim_ms)
