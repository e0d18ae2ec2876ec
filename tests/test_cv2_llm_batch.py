"""Batched LLM decode over the slot KV cache == each session decoded alone (tiny golden LLM): the same
seeded RAS tokens, for unistream sessions (with and without a voice prefix) and bistream sessions, at
ragged positions, while slots and capacity grow. Logits: within 1e-5 in float64, where only the algorithm
shows; in float32 a [B, H] GEMM rounds differently from the [1, H] one (1 ulp per layer, which the tiny
random model's logits of magnitude ~40 amplify to ~5e-5), so there the bound is relative (2e-6)."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch

from voicertc.backends.cosyvoice.llm.batch import decode_batch
from voicertc.backends.cosyvoice.llm.bistream import BistreamSession
from voicertc.backends.cosyvoice.llm.kv import SlotKV
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmConfig, build_llm
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def llm32(golden_dir):
    sys.path.insert(0, str(golden_dir))
    import make_weights

    node = load_yaml(golden_dir / "model_dir" / "cosyvoice2.yaml")["llm"]
    cfg = LlmConfig.from_yaml(node, golden_dir / "model_dir" / "CosyVoice-BlankEN" / "config.json")
    manifest = json.loads((golden_dir / "tiny_llm_manifest.json").read_text())
    recipe = json.loads((golden_dir / "tiny_llm_recipe.json").read_text())
    return build_llm(cfg, make_weights.state_dict(manifest, recipe), "llm.pt")


@pytest.fixture(scope="module", params=["float64", "float32"])
def llm(request, llm32):
    return llm32 if request.param == "float32" else copy.deepcopy(llm32).double()


MAX_LEN = 24  # tokens per session (eos is banned below 2x the text; enough to cover ragged steps)
JOBS = [  # (text, prompt text, prompt speech, seed): different lengths, so positions are ragged
    ([11, 12, 13, 14, 15, 16], [21, 22], [101, 102, 103], 1),
    ([31, 32, 33], [41, 42, 43, 44], [201, 202, 203, 204, 205, 206, 207], 2),
    ([51, 52, 53, 54, 55, 56, 57, 58, 59], [], [], 3),
    ([61, 62, 63, 64], [21, 22], [301], 4),
]


def _alone(llm, job, prefix=None):
    text, ptext, pspeech, seed = job
    session = llm.prefill(text, ptext, pspeech, generator=torch.Generator().manual_seed(seed), prefix=prefix)
    session.max_len = MAX_LEN
    tokens, logits = [], []
    while (token := llm.step(session)) is not None:
        tokens.append(token)
        logits.append(session.logits.clone())
    return tokens, logits


def _batched(llm, pool, jobs, prefixes=None):
    sessions = []
    for n, (text, ptext, pspeech, seed) in enumerate(jobs):
        prefix = prefixes[n] if prefixes else None
        sessions.append(
            llm.prefill(
                text,
                ptext,
                pspeech,
                generator=torch.Generator().manual_seed(seed),
                prefix=prefix,
                kv=pool.acquire(),
            )  # fmt: skip
        )
        sessions[-1].max_len = MAX_LEN
    tokens = [[] for _ in jobs]
    logits = [[] for _ in jobs]
    sizes = []
    while live := [i for i, s in enumerate(sessions) if not s.finished]:
        sizes.append(len(live))
        for i, result in zip(live, decode_batch(llm, [sessions[i] for i in live]), strict=True):
            assert not isinstance(result, BaseException), result
            if result is not None:
                tokens[i].append(result)
                logits[i].append(sessions[i].logits.clone())
    for s in sessions:
        s.cache.release()
    return tokens, logits, sizes


def _close(b, a):
    # float32: a [B, H] GEMM rounds differently from [1, H] (~1 ulp a layer); how differently depends on
    # the thread count's blocking (2.2e-6 of max |logit| seen with one thread, the make test workers')
    tol = 1e-5 if a.dtype == torch.float64 else 4e-6 * float(a.abs().max())
    torch.testing.assert_close(b, a, atol=tol, rtol=0)


def _same(alone, batched):
    (tokens_a, logits_a), (tokens_b, logits_b) = alone, batched
    assert tokens_a == tokens_b and len(tokens_a) > 5
    for a, b in zip(logits_a, logits_b, strict=True):
        _close(b, a)


def test_batched_decode_equals_each_session_alone(llm):
    pool = SlotKV(llm.llm.model.model, slots=2, capacity=8)  # both grow during the run
    tokens, logits, sizes = _batched(llm, pool, JOBS)
    assert pool.grows >= 2 and max(sizes) == len(JOBS) and pool.in_use == 0
    for n, job in enumerate(JOBS):
        _same(_alone(llm, job), (tokens[n], logits[n]))


def test_batched_decode_from_voice_prefixes_equals_alone(llm):
    prefixes = [llm.prefix_cache(job[1]) for job in JOBS]
    pool = SlotKV(llm.llm.model.model, slots=8, capacity=64)
    tokens, logits, _ = _batched(llm, pool, JOBS, prefixes)
    for n, job in enumerate(JOBS):
        _same(_alone(llm, job, prefixes[n]), (tokens[n], logits[n]))


TEXT = [[11, 12, 13, 14, 15, 16, 17], [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42]]


def _bistream(llm, n, kv=None):
    session = BistreamSession.start(
        llm, [21, 22, 23], [101 + i for i in range(4 + 9 * n)],
        generator=torch.Generator().manual_seed(10 + n), kv=kv,
    )  # fmt: skip
    session.push_text(TEXT[n][:6])
    return session


def _feed_more(session, n, steps):
    if steps == 3:
        session.push_text(TEXT[n][6:])
    if steps == 20:
        session.end_text()


def test_batched_bistream_equals_each_session_alone(llm):
    expected = []
    for n in range(2):
        session, tokens, logits, steps = _bistream(llm, n), [], [], 0
        while not session.finished and steps < 60:
            _feed_more(session, n, steps)
            steps += 1
            token = session.step()
            if session.logits is not None:
                logits.append(session.logits.clone())
            tokens.append(token)
        expected.append((tokens, logits))
    pool = SlotKV(llm.llm.model.model, slots=2, capacity=16)
    sessions = [_bistream(llm, n, pool.acquire()) for n in range(2)]
    got = [([], []), ([], [])]
    steps = 0
    while any(not s.finished for s in sessions) and steps < 60:
        live = [n for n in range(2) if not sessions[n].finished]
        for n in live:
            _feed_more(sessions[n], n, steps)
        steps += 1
        for n, token in zip(live, decode_batch(llm, [sessions[n] for n in live]), strict=True):
            assert not isinstance(token, BaseException)
            got[n][0].append(token)
            got[n][1].append(sessions[n].logits.clone())
    for n in range(2):
        assert got[n][0] == expected[n][0]
        assert len([t for t in got[n][0] if t is not None]) > 10
        for a, b in zip(expected[n][1], got[n][1], strict=True):
            _close(b, a)


def test_a_failing_row_fails_alone(llm):
    pool = SlotKV(llm.llm.model.model, slots=4, capacity=64)
    good = llm.prefill([1, 2, 3], generator=torch.Generator().manual_seed(0), kv=pool.acquire())
    bad = llm.prefill([1, 2, 3], generator=torch.Generator().manual_seed(0), kv=pool.acquire())
    bad.cache.release()
    results = decode_batch(llm, [good, bad])
    assert isinstance(results[0], int) and isinstance(results[1], ValueError)
