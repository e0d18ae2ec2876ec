"""Inference modes: the assembled LLM input (ids and segment order) is what cosyvoice.md §2.5 / §3.2 say.

For each mode: zero-shot (transcript + prompt speech), cross-lingual (a voice without transcript: neither),
instruct2 (instruction + <|endofprompt|>, no prompt speech), sft (neither), and fine-grained tags (single
special ids in the text). Checked on the pure assembly, then on what the running engine really prefills.
"""

from __future__ import annotations

import pytest
import torch
from cv2_engine_helpers import SFT_VOICE, build_speaking_model_dir, load_speaking_model, make_backend
from engine_helpers import EventLog, RecordingSink
from safetensors.torch import load_file

from voicertc.backends.cosyvoice.serve.modes import instruct_text, llm_prompt, lm_input_segments
from voicertc.backends.cosyvoice.voice.text import ENDOFPROMPT, V2_SPECIAL_TOKENS
from voicertc.backends.cosyvoice.voice.voices import voice_from_features
from voicertc.engine.protocol import Done, SpeakOptions
from voicertc.engine.worker import EngineWorker
from voicertc.errors import InputError

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    return load_speaking_model(
        build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("m"))
    )


@pytest.fixture(scope="module")
def voices(model, golden_dir):
    """A zero-shot voice (golden prompt + transcript) and a cross-lingual one (same prompt, no transcript)."""
    tts = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")
    prompt = (tts["in_prompt_token"], tts["in_prompt_feat"], tts["in_embedding"])
    transcript_ids = model.text_frontend.encode("Hello world.")
    zero_shot = voice_from_features(model, *prompt, transcript_ids, "zs", prompt_text="Hello world.")
    cross = voice_from_features(model, *prompt, None, "xl")
    return zero_shot, cross


def test_each_mode_assembles_the_reference_input(model, voices):
    zero_shot, cross = voices
    encode = model.text_frontend.encode
    tts = encode("Nice to meet you.")
    speech = tuple(zero_shot.flow_prompt_tokens[0].tolist())
    endofprompt = model.text_frontend.tokenizer.endofprompt_id

    prompt = llm_prompt(zero_shot)
    assert prompt.mode == "zero_shot"
    assert lm_input_segments(prompt, tts) == [
        ("sos", ()), ("text", (*encode("Hello world."), *tts)), ("task_id", ()), ("speech", speech),
    ]  # fmt: skip

    prompt = llm_prompt(cross)
    assert prompt.mode == "cross_lingual"
    assert lm_input_segments(prompt, tts) == [
        ("sos", ()),
        ("text", tuple(tts)),
        ("task_id", ()),
        ("speech", ()),
    ]

    prompt = llm_prompt(zero_shot, "Speak happily.", encode)
    instruct_ids = tuple(encode("Speak happily.<|endofprompt|>"))
    assert prompt.mode == "instruct" and instruct_ids[-1] == endofprompt
    assert instruct_ids.count(endofprompt) == 1
    assert lm_input_segments(prompt, tts) == [
        ("sos", ()), ("text", (*instruct_ids, *tts)), ("task_id", ()), ("speech", ()),
    ]  # fmt: skip
    assert llm_prompt(zero_shot, "用四川话说这句话<|endofprompt|>", encode).text_ids == tuple(
        encode("用四川话说这句话<|endofprompt|>")
    )  # not doubled

    sft = voice_from_features(
        model, torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, 80), torch.randn(1, 192)
    )
    assert llm_prompt(sft).mode == "sft" and lm_input_segments(llm_prompt(sft), tts)[3] == ("speech", ())


def test_instruction_text_rules():
    assert instruct_text(" Speak slowly. ") == "Speak slowly." + ENDOFPROMPT
    with pytest.raises(InputError, match="empty"):
        instruct_text("   ")
    with pytest.raises(InputError, match="limit"):
        instruct_text("x" * 501)


def test_fine_grained_tags_are_single_special_ids(model):
    tokenizer = model.text_frontend.tokenizer
    ids = model.text_frontend.encode("Well [laughter] that is <strong>so</strong> funny [breath] ok.")
    for tag in ("[laughter]", "<strong>", "</strong>", "[breath]"):
        tag_id = tokenizer.hf.convert_tokens_to_ids(tag)
        assert ids.count(tag_id) == 1, tag
    assert tokenizer.hf.convert_tokens_to_ids("[laughter]") - tokenizer.endofprompt_id == (
        V2_SPECIAL_TOKENS.index("[laughter]") - V2_SPECIAL_TOKENS.index(ENDOFPROMPT)
    )  # the reference's list order


def _spy_prefill(model, monkeypatch) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    calls: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []
    original = model.llm.prefill

    def recording(text_tokens, prompt_text_tokens=(), prompt_speech_tokens=(), **kw):
        calls.append(tuple(map(tuple, (text_tokens, prompt_text_tokens, prompt_speech_tokens))))
        return original(text_tokens, prompt_text_tokens, prompt_speech_tokens, **kw)

    monkeypatch.setattr(model.llm, "prefill", recording)
    return calls


@pytest.mark.parametrize(
    ("voice", "instruct", "mode"),
    [("zs", "", "zero_shot"), ("xl", "", "cross_lingual"), ("zs", "Speak happily.", "instruct"),
     (SFT_VOICE, "", "sft")],
)  # fmt: skip
def test_the_engine_prefills_the_mode_input(model, voices, golden_dir, monkeypatch, voice, instruct, mode):
    backend = make_backend(model, golden_dir, max_segment_tokens=30)
    for v in voices:
        backend.add_voice(v, persist=False)
    calls = _spy_prefill(model, monkeypatch)
    engine = EngineWorker(backend, name="cv2-modes")
    engine.start()
    try:
        log = EventLog()
        text = "Hi [laughter] there."
        uid = engine.open_utterance(voice, RecordingSink(), log, options=SpeakOptions(instruct=instruct))
        engine.push_text(uid, text, end=True)
        log.wait_terminal([uid], 120)
        assert isinstance(log.of(uid)[-1], Done), log.of(uid)
    finally:
        engine.stop()
    encode = model.text_frontend.encode
    tts = tuple(encode("Hi [laughter] there."))
    book_voice = backend.book.get(voice)
    expected = llm_prompt(book_voice, instruct, encode)
    assert expected.mode == mode
    assert calls == [(tts, expected.text_ids, expected.speech_ids)]
    laughter = model.text_frontend.tokenizer.hf.convert_tokens_to_ids("[laughter]")
    assert laughter in calls[0][0]
