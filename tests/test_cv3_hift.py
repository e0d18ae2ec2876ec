"""CosyVoice3 causal HiFT: f0 (float64), source and speech with the reference's noise buffers injected,
finalize=False semantics, an injected source, and the incremental vocoder equal to the reference's
whole-history re-runs (the samples each streaming call yields)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from voicertc.backends.cosyvoice.hift.causal import HiftStreamState
from voicertc.backends.cosyvoice3 import load

SPEECH = {"atol": 1e-5, "rtol": 0.0}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def whole(cv3_records):
    return cv3_records("hift_whole.safetensors")


@pytest.fixture(scope="module")
def hift(cv3_model):
    return cv3_model.hift


def test_f0_predictor_runs_in_float64_and_matches(hift, whole):
    state = HiftStreamState(final=True)
    with torch.inference_mode():
        f0 = hift.f0_predictor(whole["in_mel"].double(), state)
    assert f0.dtype == torch.float64 and f0.shape == (1, 240)
    assert_close(f0, whole["whole_f0"], rtol=1e-9, atol=0.0)


def test_whole_call_source_and_speech(hift, whole):
    wav, source = hift.infer(whole["in_mel"], finalize=True)
    assert wav.shape == (1, 115200) and source.shape == (1, 1, 115200)
    assert_close(source, whole["whole_source"], atol=1e-5, rtol=0.0)
    assert_close(wav, whole["whole_speech"], **SPEECH)


def test_non_final_call_holds_back_8_frames_and_returns_a_source_prefix(hift, whole):
    wav, source = hift.infer(whole["in_mel"], finalize=False)
    assert wav.shape == (1, (240 - 8) * 480)
    assert source.shape == (1, 1, (240 - 3) * 480)
    assert_close(wav, whole["nofinal_speech"], **SPEECH)
    assert_close(source, whole["whole_source"][:, :, : source.shape[2]], atol=1e-5, rtol=0.0)


def test_injected_source_drives_the_decoder(hift, whole):
    wav, used = hift.infer(whole["in_mel"], finalize=True, source=whole["whole_source"])
    assert torch.equal(used, whole["whole_source"])
    assert_close(wav, whole["whole_speech"], **SPEECH)
    silent, _ = hift.infer(whole["in_mel"], finalize=True, source=torch.zeros_like(whole["whole_source"]))
    assert (silent - whole["whole_speech"]).abs().max() > 1e-3  # the source really is used


def test_set_noise_applies_to_later_calls(tiny_cv3_model_dir, whole):
    model = load(tiny_cv3_model_dir)
    before, _ = model.hift.infer(whole["in_mel"][:, :, :40])
    model.hift.set_noise(whole["buf_rand_ini"], whole["buf_sine_waves_prefix"])
    wav, source = model.hift.infer(whole["in_mel"], finalize=True)
    assert_close(source, whole["whole_source"], atol=1e-5, rtol=0.0)
    assert (before - wav[:, : before.shape[1]]).abs().max() > 1e-4  # own buffers differ from upstream's
    with pytest.raises(ValueError, match="rand_ini"):
        model.hift.set_noise(torch.zeros(1, 8), whole["buf_sine_waves_prefix"])


@pytest.mark.parametrize("record", ["hift_stream.safetensors", "cv3_tts_stream.safetensors"])
def test_incremental_vocoder_yields_what_the_reference_rerun_yields(hift, cv3_records, record):
    """Calls 0/1/2 of the official stream re-run HiFT over 58 / 158 / 240 accumulated frames and yield
    the new samples; the incremental vocoder fed only the new frames yields the same samples."""
    rec = cv3_records(record)
    state, done = HiftStreamState(), 0
    for k, (frames, final) in enumerate([(58, False), (158, False), (240, True)]):
        mel = rec[f"stream_call{k}_hift_in_mel"]
        assert mel.shape[2] == frames
        out, source = hift.step(mel[:, :, done:], state, final=final)
        assert_close(out, rec[f"stream_call{k}_yield_speech"], **SPEECH)
        reference_source = rec[f"stream_call{k}_hift_source"]
        assert_close(
            source, reference_source[:, :, reference_source.shape[2] - source.shape[2] :], atol=1e-5, rtol=0
        )
        done = frames
    assert state.emitted == 240 * 480 and state.finished


@pytest.mark.parametrize("step", [13, 60])
def test_any_chunking_gives_the_whole_call(hift, whole, step):
    state, outs, sizes = HiftStreamState(), [], []
    for start in range(0, 240, step):
        final = start + step >= 240
        out, _ = hift.step(whole["in_mel"][:, :, start : start + step], state, final=final)
        outs.append(out)
        sizes.append(state.emitted)
        if not final:
            assert state.emitted == max(min(start + step, 240) - 8, 0) * 480
    assert sizes[-1] == 240 * 480
    assert_close(torch.cat(outs, dim=1), whole["whole_speech"], **SPEECH)


def test_a_finished_stream_refuses_more(hift, whole):
    state = HiftStreamState()
    hift.step(whole["in_mel"][:, :, :20], state, final=True)
    with pytest.raises(ValueError, match="finalized"):
        hift.step(whole["in_mel"][:, :, 20:30], state, final=False)
