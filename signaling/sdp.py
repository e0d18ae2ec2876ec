"""Checks on offers and trickle fragments before aiortc sees them: bad input is a 400 naming the problem."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from aiortc.sdp import SessionDescription, candidate_from_sdp

from signaling.errors import ApiError

MAX_SDP_BYTES = 64 * 1024  # a browser offer is a few KB; this bounds what the parsers ever see
DIGEST_BYTES = {"sha-256": 32, "sha-384": 48, "sha-512": 64}  # the DTLS fingerprints aiortc can verify
_BAD_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
_LINE = re.compile(r"[a-z]=")  # every SDP line is <type>=<value>
_M_LINE = re.compile(
    r"m=(?P<kind>[a-z]+) (?P<port>[0-9]{1,5})(?:/[0-9]{1,5})? [A-Za-z0-9/]+(?P<fmt>( \S+)+) *"
)


@dataclass
class SdpFrag:
    """What a trickle-ice-sdpfrag carries: candidates as (mid, 'candidate:...'), end-of-candidates,
    and the ICE credentials it names (new ones mean an ICE restart)."""

    candidates: list[tuple[str | None, str]] = field(default_factory=list)
    end: bool = False
    ice_ufrag: str | None = None
    ice_pwd: str | None = None


def check_size(sdp: str, what: str) -> None:
    """413 naming the limit when an offer or fragment is larger than MAX_SDP_BYTES."""
    size = len(sdp.encode("utf-8", "surrogatepass"))
    if size > MAX_SDP_BYTES:
        raise ApiError(413, "sdp_too_large", f"{what} has {size} bytes; the limit is {MAX_SDP_BYTES}")


def check_offer(sdp: str) -> None:
    """Raise ApiError 400 unless `sdp` parses and offers an audio m-line we can send on.

    The m-lines, DTLS fingerprints and characters are checked here, not left to aiortc: its parser
    asserts (gone under `python -O`) and its connect task fails later, unobserved, on a fingerprint
    it cannot use.
    """
    check_size(sdp, "SDP offer")
    if not sdp.strip().startswith("v=0"):
        raise ApiError(400, "bad_sdp", "SDP offer must start with 'v=0'")
    check_lines(sdp)
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
    if not all(m.ice is not None and m.ice.usernameFragment and m.ice.password for m in parsed.media):
        raise ApiError(400, "bad_sdp", "SDP offer lacks ICE credentials (a=ice-ufrag, a=ice-pwd)")


def check_lines(sdp: str) -> None:
    """400 `bad_sdp` for characters, lines, m-lines or DTLS fingerprints that are not usable SDP."""
    if match := _BAD_CHARS.search(sdp):
        raise ApiError(400, "bad_sdp", f"SDP has a control character U+{ord(match.group()):04X}")
    session_fingerprints: list[str] = []
    media: list[tuple[str, list[str]]] = []  # (m-line, its fingerprint values)
    for number, line in enumerate(sdp.splitlines(), start=1):
        if not line.strip():
            continue
        if not _LINE.match(line):
            raise ApiError(400, "bad_sdp", f"line {number} is not '<letter>=<value>': {line[:80]!r}")
        if line.startswith("m="):
            check_m_line(line, number)
            media.append((line, []))
        elif line.startswith("a=fingerprint:"):
            value = line[len("a=fingerprint:") :]
            check_fingerprint(value, number)
            (media[-1][1] if media else session_fingerprints).append(value)
    for m_line, fingerprints in media:
        usable = [f for f in fingerprints or session_fingerprints if f.split()[0].lower() in DIGEST_BYTES]
        if not usable:
            raise ApiError(
                400,
                "bad_sdp",
                f"{m_line[:40]!r} has no DTLS fingerprint with {'/'.join(DIGEST_BYTES)} (a=fingerprint)",
            )


def check_m_line(line: str, number: int) -> None:
    """`m=<media> <port>[/<count>] <proto> <fmt> ...`; audio/video formats are payload types 0..127."""
    match = _M_LINE.fullmatch(line)
    if match is None:
        raise ApiError(400, "bad_sdp", f"line {number} is not a valid m-line: {line[:80]!r}")
    kind, port, formats = match.group("kind"), int(match.group("port")), match.group("fmt").split()
    if port > 65535:
        raise ApiError(400, "bad_sdp", f"line {number}: port {port} is out of range")
    if kind in ("audio", "video") and not all(f.isdigit() and int(f) <= 127 for f in formats):
        raise ApiError(400, "bad_sdp", f"line {number}: {kind} formats must be payload types 0..127")


def check_fingerprint(value: str, number: int) -> None:
    """`a=fingerprint:<hash> <hex pairs>`; a hash aiortc checks must have exactly its digest length."""
    parts = value.split()
    if len(parts) != 2:
        raise ApiError(400, "bad_sdp", f"line {number}: a=fingerprint needs '<hash> <hex>'")
    algorithm, digest = parts[0].lower(), parts[1]
    size = DIGEST_BYTES.get(algorithm)
    if size is not None and not re.fullmatch(rf"[0-9A-Fa-f]{{2}}(?::[0-9A-Fa-f]{{2}}){{{size - 1}}}", digest):
        raise ApiError(
            400, "bad_sdp", f"line {number}: {algorithm} fingerprint must be {size} hex bytes joined by ':'"
        )


def check_not_restart(frag: SdpFrag, remote_ice: set[tuple[str, str]]) -> None:
    """422 when the fragment names ICE credentials other than the offer's: an ICE restart, which
    voicertc does not support (a client starts a new call instead)."""
    ufrags = {ufrag for ufrag, _ in remote_ice}
    pwds = {pwd for _, pwd in remote_ice}
    if (frag.ice_ufrag is not None and frag.ice_ufrag not in ufrags) or (
        frag.ice_pwd is not None and frag.ice_pwd not in pwds
    ):
        raise ApiError(
            422,
            "ice_restart_unsupported",
            "new ICE credentials (an ICE restart) are not supported: start a new call",
        )


def parse_sdpfrag(body: str) -> SdpFrag:
    """Parse a trickle-ice-sdpfrag (RFC 8840): candidates, end-of-candidates, ICE credentials."""
    check_size(body, "SDP fragment")
    if match := _BAD_CHARS.search(body):
        raise ApiError(400, "bad_sdpfrag", f"SDP fragment has a control character U+{ord(match.group()):04X}")
    mid: str | None = None
    frag = SdpFrag()
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
            frag.candidates.append((mid, value))
        elif line == "a=end-of-candidates":
            frag.end = True
        elif line.startswith("a=ice-ufrag:"):
            frag.ice_ufrag = line[len("a=ice-ufrag:") :]
        elif line.startswith("a=ice-pwd:"):
            frag.ice_pwd = line[len("a=ice-pwd:") :]
        elif line[:2] not in ("a=", "m=", "c="):
            raise ApiError(400, "bad_sdpfrag", f"not an SDP fragment line: {line[:80]!r}")
    return frag
