"""An in-process aiortc peer that plays the browser: offers recvonly audio + an `events` data channel,
records what it hears (48 kHz mono float) and the events it receives."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import numpy as np
from aiortc import (
    RTCConfiguration,
    RTCIceServer,
    RTCIceTransportPolicy,
    RTCPeerConnection,
    RTCSessionDescription,
)
from aiortc.mediastreams import AudioStreamTrack, MediaStreamError

from voicertc.config import Config, config_from_dict


def fake_config(**sections: dict[str, Any]) -> Config:
    """Defaults with the fake engine on loopback; `sections` override keys per section."""
    data: dict[str, dict[str, Any]] = {
        "engine": {"backend": "fake"},
        "webrtc": {"loopback_only": True, "connect_timeout_s": 20.0},
        "fake": {"ttfa_ms": 20, "rtf": 0.05},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return config_from_dict(data)


class PeerClient:
    """The browser side of a call, in-process. Owned by the test's event loop."""

    def __init__(
        self,
        audio: bool = True,
        channel: bool = True,
        mic: bool = False,
        ice_servers: list[RTCIceServer] | None = None,
        relay_only: bool = False,
    ) -> None:
        """`mic` offers sendrecv audio with a (silent) microphone track instead of recvonly;
        `relay_only` gathers only TURN relay candidates from `ice_servers`."""
        policy = RTCIceTransportPolicy.RELAY if relay_only else RTCIceTransportPolicy.ALL
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=ice_servers or [], iceTransportPolicy=policy))
        self.events: list[dict[str, Any]] = []
        self.event_arrived = asyncio.Event()
        self.pcm: list[np.ndarray] = []
        self._reader: asyncio.Task[None] | None = None
        self.channel = self.pc.createDataChannel("events") if channel else None
        if self.channel is not None:
            self.channel.on("message", self._on_message)
        if audio and mic:
            self.pc.addTrack(AudioStreamTrack())
        elif audio:
            self.pc.addTransceiver("audio", direction="recvonly")
        self.pc.on("track", self._on_track)

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def accept(self, answer_sdp: str) -> None:
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer_sdp, type="answer"))

    def _on_track(self, track: Any) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read(track))

    async def _read(self, track: Any) -> None:
        with contextlib.suppress(MediaStreamError, asyncio.CancelledError):
            while True:
                frame = await track.recv()
                pcm = frame.to_ndarray().astype(np.float32) / 32768.0  # [1, samples * channels] packed
                channels = len(frame.layout.channels)
                self.pcm.append(pcm.reshape(-1, channels).mean(axis=1))

    def _on_message(self, message: str) -> None:
        self.events.append(json.loads(message))
        self.event_arrived.set()

    async def wait_event(self, kind: str, timeout_s: float = 10.0, utterance_id: str | None = None) -> dict:
        async def find() -> dict:
            while True:
                for event in self.events:
                    if event["type"] == kind and (
                        utterance_id is None or event.get("utterance_id") == utterance_id
                    ):
                        return event
                self.event_arrived.clear()
                await self.event_arrived.wait()

        return await asyncio.wait_for(find(), timeout_s)

    async def wait_open(self, timeout_s: float = 10.0) -> None:
        if self.channel is None or self.channel.readyState == "open":
            return
        opened = asyncio.Event()
        self.channel.on("open", opened.set)
        await asyncio.wait_for(opened.wait(), timeout_s)

    def send(self, message: dict[str, Any]) -> None:
        assert self.channel is not None
        self.channel.send(json.dumps(message))

    def audio(self) -> np.ndarray:
        return np.concatenate(self.pcm) if self.pcm else np.zeros(0, np.float32)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self.pc.close()


def rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(pcm)))) if pcm.size else 0.0
