"""The WebRTC side: the paced speech track and ICE helpers. No torch here."""

from __future__ import annotations

from voicertc.webrtc.loopback import loopback_only_sdp, patch_aioice_loopback
from voicertc.webrtc.track import InterruptResult, PlayoutEvent, SpeechTrack, TrackStats

__all__ = [
    "InterruptResult",
    "PlayoutEvent",
    "SpeechTrack",
    "TrackStats",
    "loopback_only_sdp",
    "patch_aioice_loopback",
]
