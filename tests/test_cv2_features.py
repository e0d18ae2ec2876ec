"""Prompt-audio features (golden §B5 mel, independent numpy Whisper/Kaldi versions) and the ONNX frontends."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from voicertc.backends.cosyvoice.voice.features import (
    kaldi_fbank,
    kaldi_mel_banks,
    prompt_mel,
    resample_wav,
    slaney_mel_basis,
    whisper_log_mel,
)
from voicertc.backends.cosyvoice.voice.onnx_frontends import CampPlus, SpeechTokenizer
from voicertc.errors import InputError, ModelDirError

torch.set_num_threads(2)


def _test_signal(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """Two harmonics with a moving pitch, a gap and a little noise (float64)."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = 180 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    y = 0.3 * np.sin(phase) + 0.1 * np.sin(3 * phase)
    y[(t > 0.3) & (t < 0.4)] = 0.0
    return y + 0.003 * np.random.RandomState(seed).randn(t.size)


# ---- prompt mel (Matcha mel_spectrogram) -------------------------------------------------------


@pytest.mark.parametrize("fmax_key, fmax_hz", [("fmax8000", 8000.0), ("fmaxNone", None)])
def test_mel_basis_matches_librosa(golden_dir, fmax_key, fmax_hz):
    ref = load_file(golden_dir / "mel_extractor.safetensors")[f"mel_basis_{fmax_key}"].numpy()
    np.testing.assert_allclose(slaney_mel_basis(24000, 1920, 80, 0.0, fmax_hz), ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "wav_key, mel_key, fmax_hz",
    [
        ("chirp_1s_wav", "chirp_mel_fmax8000", 8000.0),
        ("chirp_1s_wav", "chirp_mel_fmaxNone", None),
        ("voice8s_wav", "voice8s_mel_fmax8000", 8000.0),
    ],
)
def test_prompt_mel_matches_reference(golden_dir, wav_key, mel_key, fmax_hz):
    golden = load_file(golden_dir / "mel_extractor.safetensors")
    ref = golden[mel_key].transpose(1, 2)  # [1, T, 80]
    mel = prompt_mel(golden[wav_key][None], fmax_hz)
    assert mel.shape == ref.shape
    torch.testing.assert_close(mel.exp(), ref.exp(), rtol=0.0, atol=1e-6)
    loud = ref > -9
    torch.testing.assert_close(mel[loud], ref[loud], rtol=0.0, atol=1e-3)
    torch.testing.assert_close(mel[~loud], ref[~loud], rtol=0.0, atol=1e-2)


@pytest.mark.parametrize("samples", [961, 24000, 24479, 24480, 50000])
def test_prompt_mel_runs_at_50_hz(samples):
    wav = torch.from_numpy(_test_signal(samples / 24000, 24000)).float()[None]
    assert prompt_mel(wav).shape == (1, samples // 480, 80)


# ---- Whisper log-mel ---------------------------------------------------------------------------


def _whisper_numpy(wav: np.ndarray) -> np.ndarray:
    """float64 reference: centred reflect-padded 400-point periodic-Hann STFT, power, Slaney mel."""
    n_fft, hop = 400, 160
    padded = np.pad(wav, n_fft // 2, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    n_frames = 1 + (padded.size - n_fft) // hop
    frames = np.stack([padded[i * hop : i * hop + n_fft] * window for i in range(n_frames)])
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2  # [frames, 201]
    basis = slaney_mel_basis(16000, n_fft, 128).astype(np.float64)
    log_mel = np.log10(np.maximum(basis @ power[:-1].T, 1e-10))
    log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0


def test_whisper_log_mel_matches_numpy():
    wav = _test_signal(1.37, 16000)
    out = whisper_log_mel(torch.from_numpy(wav).float()[None])
    ref = _whisper_numpy(wav.astype(np.float32).astype(np.float64))
    assert out.shape == (1, 128, wav.size // 160)
    np.testing.assert_allclose(out[0].numpy(), ref, rtol=0, atol=1e-4)


def test_whisper_log_mel_properties():
    rate = 16000
    t = np.arange(rate) / rate
    out = whisper_log_mel(torch.from_numpy(0.5 * np.sin(2 * np.pi * 1000 * t)).float()[None])[0]
    assert out.min() >= out.max() - 2.0 - 1e-6  # floor at max - 8 decades, divided by 4
    basis = slaney_mel_basis(rate, 400, 128)
    assert int(out[:, 50].argmax()) == int(basis[:, 1000 * 400 // rate].argmax())


# ---- Kaldi fbank -------------------------------------------------------------------------------


def _kaldi_numpy(wav: np.ndarray, n_mels: int = 80) -> np.ndarray:
    """float64 reference written from the Kaldi recipe, frame by frame and bin by bin."""
    rate, frame, shift, n_fft = 16000, 400, 160, 512
    mel = lambda hz: 1127.0 * np.log(1.0 + hz / 700.0)  # noqa: E731
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(frame) / (frame - 1))) ** 0.85
    lo, hi = mel(20.0), mel(rate / 2)
    delta = (hi - lo) / (n_mels + 1)
    banks = np.zeros((n_mels, n_fft // 2 + 1))
    for m in range(n_mels):
        left, center, right = lo + m * delta, lo + (m + 1) * delta, lo + (m + 2) * delta
        for k in range(n_fft // 2):
            f = mel(k * rate / n_fft)
            if left < f < right:
                banks[m, k] = (f - left) / (center - left) if f <= center else (right - f) / (right - center)
    rows = []
    for i in range(1 + (wav.size - frame) // shift):
        x = wav[i * shift : i * shift + frame].copy()
        x -= x.mean()
        x = x - 0.97 * np.concatenate([x[:1], x[:-1]])
        power = np.abs(np.fft.rfft(x * window, n=n_fft)) ** 2
        rows.append(np.log(np.maximum(banks @ power, np.finfo(np.float32).eps)))
    return np.stack(rows)


def test_kaldi_fbank_matches_numpy():
    wav = _test_signal(0.83, 16000, seed=1)
    out = kaldi_fbank(torch.from_numpy(wav).float()[None], subtract_mean=False)
    ref = _kaldi_numpy(wav.astype(np.float32).astype(np.float64))
    assert out.shape == ref.shape == (1 + (wav.size - 400) // 160, 80)
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=2e-3)
    cmn = kaldi_fbank(torch.from_numpy(wav).float()[None])
    np.testing.assert_allclose(cmn.numpy(), ref - ref.mean(axis=0), rtol=0, atol=2e-3)
    np.testing.assert_allclose(cmn.mean(dim=0).numpy(), 0.0, atol=1e-5)


def test_kaldi_fbank_properties():
    rate = 16000
    t = np.arange(rate // 2) / rate
    dc = kaldi_fbank(torch.full((1, t.size), 0.3), subtract_mean=False)
    torch.testing.assert_close(dc, torch.full_like(dc, float(np.log(np.finfo(np.float32).eps))))
    tone_wav = torch.from_numpy(0.5 * np.sin(2 * np.pi * 1000 * t)).float()[None]
    tone = kaldi_fbank(tone_wav, subtract_mean=False)
    banks = kaldi_mel_banks()
    assert int(tone[10].argmax()) == int(banks[:, 1000 * 512 // rate].argmax())
    assert banks[:, -1].max() == 0.0 and banks.shape == (80, 257)
    with pytest.raises(InputError):
        kaldi_fbank(torch.zeros(1, 399))


def test_resample_wav_keeps_the_pitch_and_refuses_low_rates():
    t = np.arange(24000) / 24000
    wav_16k = resample_wav(np.sin(2 * np.pi * 440 * t).astype(np.float32), 24000, 16000)
    assert wav_16k.dtype == np.float32 and abs(wav_16k.size - 16000) <= 1
    spectrum = np.abs(np.fft.rfft(wav_16k[:16000]))
    assert int(spectrum.argmax()) == 440
    with pytest.raises(InputError, match="16000"):
        resample_wav(np.zeros(8000, dtype=np.float32), 8000, 16000)


# ---- ONNX frontends (tiny models exported here with the official input/output layout) ----------


class _TinyTokenizer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(128, 6561)

    def forward(self, feats: torch.Tensor, feats_length: torch.Tensor) -> torch.Tensor:
        # feats: [1, 128, T], feats_length: [1] -> tokens: [1, T // 4]
        pooled = torch.nn.functional.avg_pool1d(feats, 4, 4).transpose(1, 2)
        return self.proj(pooled).argmax(-1) + 0 * feats_length.to(torch.int64)


class _TinyCampPlus(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(80, 192)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        # feats: [1, T, 80] -> embedding: [1, 192]
        return self.proj(feats).mean(dim=1)


def _export(module: torch.nn.Module, args: tuple, path, names: list[str], dynamic: dict) -> None:
    torch.onnx.export(
        module, args, str(path), input_names=names, output_names=["out"], dynamic_axes=dynamic, dynamo=False
    )


def test_speech_tokenizer_runs_whisper_features_through_onnx(tmp_path):
    torch.manual_seed(0)
    model = _TinyTokenizer().eval()
    path = tmp_path / "speech_tokenizer_v2.onnx"
    example = (torch.randn(1, 128, 40), torch.tensor([40], dtype=torch.int32))
    _export(model, example, path, ["feats", "feats_length"], {"feats": {2: "T"}, "out": {1: "T4"}})
    tokenizer = SpeechTokenizer(path)
    wav = torch.from_numpy(_test_signal(2.0, 16000)).float()[None]
    tokens = tokenizer(wav)
    feats = whisper_log_mel(wav)
    with torch.no_grad():
        expected = model(feats, torch.tensor([feats.shape[2]], dtype=torch.int32))
    assert tokens.dtype == torch.int32 and tokens.shape == (1, 50)  # 25 Hz
    assert torch.equal(tokens, expected.to(torch.int32))
    with pytest.raises(InputError, match="30 s"):
        tokenizer(torch.zeros(1, 16000 * 31))


def test_campplus_embeds_mean_normalised_fbank(tmp_path):
    torch.manual_seed(0)
    model = _TinyCampPlus().eval()
    path = tmp_path / "campplus.onnx"
    _export(model, (torch.randn(1, 50, 80),), path, ["input"], {"input": {1: "T"}})
    wav = torch.from_numpy(_test_signal(1.0, 16000)).float()[None]
    embedding = CampPlus(path)(wav)
    with torch.no_grad():
        expected = model(kaldi_fbank(wav)[None])
    assert embedding.shape == (1, 192) and embedding.dtype == torch.float32
    torch.testing.assert_close(embedding, expected, rtol=1e-5, atol=1e-5)


def test_onnx_frontends_name_missing_or_broken_files(tmp_path):
    with pytest.raises(ModelDirError, match="campplus.onnx"):
        CampPlus(tmp_path / "campplus.onnx")
    with pytest.raises(ModelDirError, match="speech_tokenizer_v2.onnx"):
        SpeechTokenizer(tmp_path / "speech_tokenizer_v2.onnx")
    broken = tmp_path / "campplus.onnx"
    broken.write_bytes(b"not an onnx model")
    campplus = CampPlus(broken)  # lazy: nothing is read yet
    with pytest.raises(ModelDirError, match="campplus.onnx"):
        campplus(torch.zeros(1, 16000))
