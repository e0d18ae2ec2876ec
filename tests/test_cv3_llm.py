"""CosyVoice3LM: input assembly, teacher-forced logits, greedy tokens and the seeded RAS run of the
reference, v3's special ids (sos 6561 masked below min_len, 200 stop ids) and `<|endofprompt|>`."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from voicertc.backends.cosyvoice.llm.v3 import ENDOFPROMPT_ID, SOS_ID, STOP_IDS, TASK_ID

TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def rec(cv3_records):
    return cv3_records("llm_tiny.safetensors")


@pytest.fixture(scope="module")
def llm(cv3_model):
    return cv3_model.llm


def _inputs(rec):
    return rec["in_text"], rec["in_prompt_text"], rec["in_prompt_speech_token"]


def test_layout_and_special_ids(llm):
    assert llm.llm_decoder.weight.shape[0] == 6761 and llm.llm_decoder.bias is None
    assert llm.speech_embedding.weight.shape[0] == 6761 and not hasattr(llm, "llm_embedding")
    assert (SOS_ID, TASK_ID) == (6561, 6563)
    assert STOP_IDS == frozenset(range(6561, 6761)) and llm.stop_ids == STOP_IDS
    assert llm.min_len_ban_ids == (6561,)


def test_lm_input_and_teacher_forced_logits(llm, rec):
    text, prompt_text, prompt_speech = _inputs(rec)
    with torch.inference_mode():
        assert_close(llm.lm_input(text, prompt_text, prompt_speech), rec["lm_input"], **TOL)
    logits = llm.logits(text, prompt_text, prompt_speech)
    assert logits.shape == (1, 59, 6761)
    assert_close(logits, rec["teacher_forced_logits"], **TOL)


def test_greedy_tokens_and_step_logits(llm, rec):
    session = llm.prefill(*_inputs(rec), sampling="greedy")
    tokens, logits = [], []
    for _ in range(40):
        tokens.append(llm.step(session))
        logits.append(session.logits)
    assert tokens == rec["greedy_tokens"].tolist()
    assert_close(torch.stack(logits), rec["greedy_step_logits"], **TOL)
    assert (session.min_len, session.max_len) == (40, 400)
    assert list(itertools.islice(llm.generate(*_inputs(rec), sampling="greedy"), 40)) == tokens


def test_seeded_ras_run_reproduces_the_reference(llm, rec):
    torch.manual_seed(777)
    tokens = list(llm.generate(*_inputs(rec), sampling="ras"))
    assert tokens == rec["seeded_tokens"].tolist()  # step 27 samples 6729, a stop id -> ends


def test_endofprompt_is_mandatory(llm, rec):
    text, prompt_text, prompt_speech = _inputs(rec)
    without = [t for t in prompt_text[0].tolist() if t != ENDOFPROMPT_ID]
    with pytest.raises(ValueError, match="endofprompt"):
        llm.prefill(text, without, prompt_speech)
    # cross-lingual layout: the marker at the head of the text itself is enough
    text_with = [ENDOFPROMPT_ID, *text[0].tolist()]
    assert llm.prefill(text_with, [], []).min_len == 2 * len(text_with)


def test_any_of_the_200_stop_ids_ends_generation(llm, rec):
    session = llm.prefill(*_inputs(rec), sampling="greedy")
    assert llm.step(session, force=123) == 123
    assert llm.step(session, force=6700) is None and session.finished
