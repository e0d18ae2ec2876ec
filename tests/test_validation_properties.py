"""Property tests of the edge checks: on any input they return or raise their typed error, nothing else
(issue 11: the SDP check, the NDJSON reader, JSON bodies, text validation)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from call_helpers import PeerClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from signaling.errors import ApiError
from signaling.openapi import TEXT_PATTERN
from signaling.openapi_voices import FIELD_PATTERN, ID_FIELD_PATTERN
from signaling.routes import _json_body, _ndjson_deltas, _NdjsonError
from signaling.sdp import check_offer, parse_sdpfrag
from voicertc.errors import InputError
from voicertc.validate import MAX_JSON_DEPTH, BadJsonError, BadTextError, check_text, parse_json
from voicertc.voice_ids import check_voice_id

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=60)
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
UNSPEAKABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufdd0-\ufdef\ufffe\uffff]")


# --- text ----------------------------------------------------------------------------------------


@FAST
@given(ANY_TEXT)
def test_check_text_raises_bad_text_exactly_for_unspeakable_characters(text):
    try:
        check_text(text)
    except BadTextError as exc:
        assert UNSPEAKABLE.search(text) and exc.code == "bad_text"
    else:
        assert not UNSPEAKABLE.search(text)


@FAST
@given(ANY_TEXT)
def test_the_openapi_pattern_accepts_what_the_server_accepts(text):
    """Equal on every string a UTF-8 JSON body can carry; a lone surrogate (which only a `\\ud800`
    escape can spell) is left to the description, as no portable regex names one, and refused."""
    try:
        check_text(text)
        server_accepts = bool(text.strip())
    except BadTextError:
        server_accepts = False
    if LONE_SURROGATE.search(text):
        assert not server_accepts
    else:
        assert bool(re.search(TEXT_PATTERN, text)) == server_accepts


# --- JSON ----------------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ANY_TEXT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(ANY_TEXT, children, max_size=4),
    max_leaves=20,
)


@FAST
@given(st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_parse_json_only_ever_raises_bad_json(raw):
    try:
        parse_json(raw)
    except BadJsonError as exc:
        assert exc.code == "bad_json"


@FAST
@given(JSON_VALUES)
def test_parse_json_round_trips_shallow_documents(value):
    assert parse_json(json.dumps(value).encode()) == value


@FAST
@given(st.integers(MAX_JSON_DEPTH + 1, 5000), st.sampled_from(["[", '{"a":']))
def test_deep_documents_are_refused_before_parsing(depth, opener):
    closer = "]" if opener == "[" else "}"
    with pytest.raises(BadJsonError, match="deeper"):
        parse_json((opener * depth + "1" + closer * depth).encode())


class _Body:
    """The few request attributes the body readers use, over fixed bytes."""

    def __init__(self, raw: bytes, chunks: list[bytes] | None = None) -> None:
        self._raw = raw
        self.content = _Stream(chunks if chunks is not None else [raw])

    async def read(self) -> bytes:
        return self._raw


class _Stream:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = list(chunks)

    async def readany(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""


@FAST
@given(st.binary(max_size=200) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_json_bodies_are_objects_or_a_400(raw):
    try:
        body = asyncio.run(_json_body(_Body(raw)))  # type: ignore[arg-type]
    except ApiError as exc:
        assert exc.status == 400 and exc.code == "bad_json"
    else:
        assert isinstance(body, dict)


# --- NDJSON --------------------------------------------------------------------------------------

NDJSON_LINES = st.lists(
    st.one_of(
        JSON_VALUES.map(lambda v: json.dumps({"text": v}).encode()),
        ANY_TEXT.map(lambda t: json.dumps({"text": t}).encode()),
        st.binary(max_size=40),
    ),
    max_size=8,
)


async def _read_deltas(chunks: list[bytes], limit: int) -> list[str]:
    return [delta async for delta in _ndjson_deltas(_Body(b"", chunks), limit)]  # type: ignore[arg-type]


@FAST
@given(NDJSON_LINES, st.integers(1, 30), st.integers(1, 64))
def test_the_ndjson_reader_yields_speakable_text_or_raises_its_error(lines, split, limit):
    raw = b"\n".join(lines)
    chunks = [raw[i : i + split] for i in range(0, len(raw), split)]
    try:
        deltas = asyncio.run(_read_deltas(chunks, limit))
    except _NdjsonError as exc:
        assert exc.code in ("bad_ndjson", "bad_text", "text_too_long", "ndjson_too_large")
    else:
        assert sum(map(len, deltas)) <= limit
        for delta in deltas:
            check_text(delta)


# --- SDP -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offer() -> str:
    async def make() -> str:
        peer = PeerClient()
        try:
            return await peer.offer()
        finally:
            await peer.close()

    return asyncio.run(make())


def test_a_real_offer_passes(offer):
    check_offer(offer)


def _mutate(offer: str, edits: list[tuple[int, str]]) -> str:
    lines = offer.split("\r\n")
    for index, new in edits:
        lines[index % len(lines)] = new
    return "\r\n".join(lines)


SDP_LINES = st.one_of(
    ANY_TEXT,
    st.sampled_from(["", "m=audio abc", "a=fingerprint:sha-256 ZZ", "a=setup:bogus", "a=ice-pwd:", "m="]),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from("vomcatbsa"), ANY_TEXT),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.integers(0, 200), SDP_LINES), min_size=1, max_size=4))
def test_check_offer_only_ever_raises_a_4xx(offer, edits):
    try:
        check_offer(_mutate(offer, edits))
    except ApiError as exc:
        assert exc.status in (400, 413) and exc.code in ("bad_sdp", "no_audio", "sdp_too_large")


@FAST
@given(ANY_TEXT)
def test_check_offer_on_any_text(text: Any):
    try:
        check_offer(text)
    except ApiError as exc:
        assert exc.status in (400, 413)


@FAST
@given(st.lists(SDP_LINES | st.just("a=candidate:1 1 udp 1 127.0.0.1 9 typ host"), max_size=6))
def test_parse_sdpfrag_only_ever_raises_a_400(lines):
    try:
        parse_sdpfrag("\r\n".join(lines))
    except ApiError as exc:
        assert exc.status in (400, 413)


# --- voice registration fields -------------------------------------------------------------------

VOICE_IDS = st.one_of(
    ANY_TEXT,
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,70}", fullmatch=True),
    st.sampled_from(["con", "NUL", "Com1", "lpt9.json", "aux.", "console", "nul-1", "com10"]),
)
PADDING = st.text(st.sampled_from(" \t\n\r\x0b\x0c\x1c\x85\xa0\u2028\u3000"), max_size=3)


def _server_takes_voice_id(text: str) -> bool:
    """What POST /v1/voices does with an `id` field: check_text, strip, blank = none, else check_voice_id."""
    try:
        check_text(text)
        if text.strip():
            check_voice_id(text.strip())
    except InputError:
        return False
    return True


@FAST
@given(PADDING, VOICE_IDS, PADDING)
def test_the_voice_id_pattern_accepts_what_the_server_accepts(before, voice_id, after):
    text = before + voice_id + after
    assert bool(re.search(ID_FIELD_PATTERN, text)) == _server_takes_voice_id(text)


@FAST
@given(ANY_TEXT)
def test_the_voice_field_pattern_accepts_what_the_server_accepts(text):
    try:
        check_text(text)
        server_accepts = True
    except BadTextError:
        server_accepts = False
    if LONE_SURROGATE.search(text):
        assert not server_accepts
    else:
        assert bool(re.search(FIELD_PATTERN, text)) == server_accepts
