"""SpeakRequest.parse: every speak entry point's one check (text, voice, interrupt, instruct, speed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from voicertc.errors import InputError, UnknownVoiceError
from voicertc.validate import (
    BadFieldError,
    BadTextError,
    OptionNotSupportedError,
    SpeakRequest,
    SpeakRequestError,
    SpeakRules,
    SpeedNotSupportedError,
    TextTooLongError,
    UnknownSpeakVoiceError,
)

RULES = SpeakRules(max_text_chars=20, voices=["ann", "bob"], features=["instruct", "speed"])
PLAIN = SpeakRules(max_text_chars=20, voices=["ann"])


def test_a_good_request_keeps_every_field():
    req = SpeakRequest.parse(
        {"text": "Hello.", "voice": "bob", "interrupt": True, "instruct": "  softly ", "speed": 1.5}, RULES
    )
    assert req == SpeakRequest(text="Hello.", voice="bob", interrupt=True, instruct="softly", speed=1.5)


def test_defaults():
    assert SpeakRequest.parse({"text": "Hi"}, PLAIN) == SpeakRequest(text="Hi")


@pytest.mark.parametrize(
    ("fields", "error", "code", "status"),
    [
        ({}, SpeakRequestError, "bad_input", 400),
        ({"text": "   "}, SpeakRequestError, "bad_input", 400),
        ({"text": 5}, SpeakRequestError, "bad_input", 400),
        ({"text": "x" * 21}, TextTooLongError, "text_too_long", 413),
        ({"text": "a\x00b"}, BadTextError, "bad_text", 400),
        ({"text": "Hi", "voice": "carl"}, UnknownSpeakVoiceError, "unknown_voice", 400),
        ({"text": "Hi", "voice": 3}, BadFieldError, "bad_request", 400),
        ({"text": "Hi", "voice": ""}, BadFieldError, "bad_request", 400),
        ({"text": "Hi", "interrupt": "yes"}, BadFieldError, "bad_request", 400),
        ({"text": "Hi", "instruct": 4}, SpeakRequestError, "bad_input", 400),
        ({"text": "Hi", "instruct": "loud\x01"}, BadTextError, "bad_text", 400),
        ({"text": "Hi", "speed": "fast"}, SpeakRequestError, "bad_input", 400),
        ({"text": "Hi", "speed": True}, SpeakRequestError, "bad_input", 400),
        ({"text": "Hi", "speed": float("nan")}, SpeakRequestError, "bad_input", 400),
        ({"text": "Hi", "speed": 3.0}, SpeakRequestError, "bad_input", 400),
    ],
)
def test_each_problem_has_one_error(fields, error, code, status):
    with pytest.raises(error) as info:
        SpeakRequest.parse(fields, RULES)
    assert info.value.code == code and info.value.status == status
    assert isinstance(info.value, InputError)


def test_an_unknown_voice_is_an_unknown_voice_error():
    with pytest.raises(UnknownVoiceError, match="carl"):
        SpeakRequest.parse({"text": "Hi", "voice": "carl"}, RULES)


def test_options_the_engine_does_not_honour_are_refused():
    with pytest.raises(OptionNotSupportedError):
        SpeakRequest.parse({"text": "Hi", "instruct": "whisper"}, PLAIN)
    with pytest.raises(SpeedNotSupportedError):
        SpeakRequest.parse({"text": "Hi", "speed": 0.9}, PLAIN)
    assert SpeakRequest.parse({"text": "Hi", "speed": 1, "instruct": " "}, PLAIN).speed == 1.0


def test_a_streamed_request_has_no_text_and_skips_the_text_checks():
    req = SpeakRequest.parse({"voice": "ann"}, PLAIN, streamed=True)
    assert req.text is None and req.voice == "ann"
    with pytest.raises(UnknownSpeakVoiceError):
        SpeakRequest.parse({"voice": "zed"}, PLAIN, streamed=True)


def test_voices_unchecked_when_the_rules_do_not_know_them():
    assert (
        SpeakRequest.parse({"text": "Hi", "voice": "anyone"}, SpeakRules(max_text_chars=5)).voice == "anyone"
    )


@given(
    st.dictionaries(
        st.sampled_from(["text", "voice", "interrupt", "instruct", "speed"]), st.from_type(object)
    )
)
def test_any_fields_either_parse_or_raise_a_speak_error(fields):
    try:
        req = SpeakRequest.parse(fields, RULES)
    except (SpeakRequestError, BadTextError) as exc:
        assert exc.code and exc.status in (400, 413)
    else:
        assert isinstance(req.text, str) and 0 < len(req.text) <= RULES.max_text_chars
        assert req.voice in (None, "ann", "bob")
        assert 0.5 <= req.speed <= 2.0
