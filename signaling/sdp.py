"""Checks on offers and trickle fragments before aiortc sees them: bad input is a 400 naming the problem."""

from __future__ import annotations

from aiortc.sdp import SessionDescription, candidate_from_sdp

from signaling.errors import ApiError

MAX_SDP_BYTES = 64 * 1024


def check_offer(sdp: str) -> None:
    """Raise ApiError 400 unless `sdp` parses and offers an audio m-line we can send on."""
    if not sdp.strip().startswith("v=0"):
        raise ApiError(400, "bad_sdp", "SDP offer must start with 'v=0'")
    try:
        parsed = SessionDescription.parse(sdp)
    except Exception as exc:  # noqa: BLE001 - aiortc raises assorted errors on bad SDP
        raise ApiError(400, "bad_sdp", f"SDP offer does not parse: {type(exc).__name__}: {exc}") from exc
    audio = [m for m in parsed.media if m.kind == "audio"]
    if not audio:
        raise ApiError(400, "no_audio", "SDP offer has no audio m-line: add an audio transceiver (recvonly)")
    if all(m.direction in ("sendonly", "inactive") for m in audio):
        raise ApiError(400, "no_audio", "SDP offer's audio is sendonly/inactive: it must be able to receive")
    if not any(
        c.mimeType.lower() in ("audio/opus", "audio/pcmu", "audio/pcma") for m in audio for c in m.rtp.codecs
    ):
        raise ApiError(400, "no_audio", "SDP offer has no audio codec the server can send (Opus, PCMU, PCMA)")
    if not all(m.ice.usernameFragment and m.dtls for m in parsed.media):
        raise ApiError(400, "bad_sdp", "SDP offer lacks ICE credentials or a DTLS fingerprint")


def parse_sdpfrag(body: str) -> tuple[list[tuple[str | None, str]], bool]:
    """Candidates (mid, candidate attribute value) and end-of-candidates of a trickle-ice-sdpfrag (RFC 8840).

    A fragment that carries new ICE credentials is an ICE restart, which voicertc does not support (422).
    """
    mid: str | None = None
    candidates: list[tuple[str | None, str]] = []
    end = False
    for raw in body.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("m="):
            mid = None
        elif line.startswith("a=mid:"):
            mid = line[len("a=mid:") :]
        elif line.startswith("a=candidate:"):
            value = line[len("a=") :]
            try:
                candidate_from_sdp(value[len("candidate:") :])
            except Exception as exc:  # noqa: BLE001
                raise ApiError(400, "bad_candidate", f"cannot parse {line!r}: {exc}") from exc
            candidates.append((mid, value))
        elif line == "a=end-of-candidates":
            end = True
        elif (
            line.startswith("a=ice-ufrag:")
            or line.startswith("a=ice-pwd:")
            or line.startswith("a=ice-options:")
        ):
            continue
        elif line[:2] not in ("a=", "m=", "c="):
            raise ApiError(400, "bad_sdpfrag", f"not an SDP fragment line: {line[:80]!r}")
    return candidates, end
