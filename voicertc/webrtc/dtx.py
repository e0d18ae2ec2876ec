"""Discontinuous transmission (DTX) of an outgoing Opus stream: what a silent sender puts on the wire.

A WebRTC sender with Opus DTX on (libwebrtc with `usedtx=1`) does this: after 200 ms of silence it
sends one packet holding only the Opus TOC byte (a frame of length zero: "DTX", RFC 6716 §3.2.1),
then nothing, and repeats that packet every 400 ms while the silence lasts. The RTP sequence numbers
stay contiguous and the timestamps jump over the silence, so a receiver sees no loss: NetEq takes a
packet of at most 2 bytes as DTX and plays silence with no concealment; aiortc's decoder turns it
into a silent 20 ms frame. A silent call then costs 2.5 packets a second instead of 50.

`DtxSchedule` is that decision per 20 ms frame, pure (no clock): the track asks it for each frame
whether the frame is sent, replaced by the DTX packet, or skipped, and how many frames it may sleep.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

HANGOVER_FRAMES = 10  # silent frames sent as usual before DTX starts (libopus: 200 ms)
REFRESH_FRAMES = 20  # in DTX, one DTX packet per this many frames (libopus: 400 ms)


class FrameAction(Enum):
    SEND = "send"  # the frame goes out (speech, or silence within the hangover)
    DTX = "dtx"  # the 1-byte DTX packet goes out in the frame's place
    SKIP = "skip"  # nothing goes out; the frame's time passes


@dataclass
class DtxSchedule:
    """Per outgoing stream: `silent_run` frames of silence so far, the current one included.

    Invariants: in a run of silence, frames 1..hangover are SEND, frame hangover+1 is DTX, and
    after it every `refresh_frames`-th frame is DTX, the others SKIP; any sound ends the run.
    """

    hangover_frames: int = HANGOVER_FRAMES
    refresh_frames: int = REFRESH_FRAMES
    silent_run: int = 0

    def __post_init__(self) -> None:
        if self.hangover_frames < 0 or self.refresh_frames < 1:
            raise ValueError(
                f"DtxSchedule: hangover_frames must be >= 0 and refresh_frames >= 1, "
                f"got {self.hangover_frames}, {self.refresh_frames}"
            )

    def action(self, silent: bool) -> FrameAction:
        """The next frame's fate; `silent`: it holds only zeros."""
        if not silent:
            self.silent_run = 0
            return FrameAction.SEND
        self.silent_run += 1
        return self._action_at(self.silent_run)

    def _action_at(self, run: int) -> FrameAction:
        in_dtx = run - self.hangover_frames  # 1 = the first frame in DTX
        if in_dtx <= 0:
            return FrameAction.SEND
        return FrameAction.DTX if (in_dtx - 1) % self.refresh_frames == 0 else FrameAction.SKIP

    @property
    def in_dtx(self) -> bool:
        """The last frame was the DTX packet or skipped."""
        return self.silent_run > self.hangover_frames

    def frames_until_dtx(self) -> int:
        """In DTX: how many frames after the last one the next DTX packet is due (1..refresh_frames)."""
        in_dtx = self.silent_run - self.hangover_frames
        return self.refresh_frames - (in_dtx - 1) % self.refresh_frames

    def skip(self, frames: int) -> None:
        """`frames` silent frames passed without being asked for (all of them SKIP)."""
        if frames < 0 or (frames and frames >= self.frames_until_dtx()):
            raise ValueError(f"DtxSchedule.skip: {frames} frames would pass a DTX packet")
        self.silent_run += frames


def dtx_packet(silence_payload: bytes) -> bytes:
    """The DTX packet of a stream whose silent frames encode to `silence_payload`: its TOC byte (same
    mode, bandwidth, frame size and channels) with frame count code 0 and no frame data."""
    if not silence_payload:
        raise ValueError("dtx_packet: an empty Opus packet has no TOC byte")
    return bytes([silence_payload[0] & 0xFC])


def ask_for_dtx(answer_sdp: str) -> str:
    """The answer with `usedtx=1` on its first audio section's Opus format (RFC 7587 §7): the caller's
    encoder then sends its microphone's silences as DTX. Other codecs and sections are left alone."""
    lines = answer_sdp.split("\r\n")
    audio = next((i for i, line in enumerate(lines) if line.startswith("m=audio ")), None)
    if audio is None:
        return answer_sdp
    end = next((i for i in range(audio + 1, len(lines)) if lines[i].startswith("m=")), len(lines))
    section = lines[audio:end]
    opus = next(
        (
            line.split()[0].removeprefix("a=rtpmap:")
            for line in section
            if line.startswith("a=rtpmap:") and line.split()[1].lower().startswith("opus/48000")
        ),
        None,
    )
    if opus is None:
        return answer_sdp
    fmtp = f"a=fmtp:{opus} "
    at = next((i for i, line in enumerate(section) if line.startswith(fmtp)), None)
    if at is None:
        rtpmap = next(i for i, line in enumerate(section) if line.startswith(f"a=rtpmap:{opus} "))
        section.insert(rtpmap + 1, fmtp + "usedtx=1")
    elif "usedtx=" not in section[at]:
        section[at] += ";usedtx=1"
    return "\r\n".join(lines[:audio] + section + lines[end:])
