"""CosyVoice2's HiFT vocoder: 80-bin mel at 50 Hz -> 24 kHz waveform (480 samples per mel frame).

An f0 predictor drives a neural-source-filter excitation; a HiFi-GAN style upsampler fused with the
STFT of that excitation predicts a 16-point STFT, which an inverse STFT turns into audio. Module names
mirror the official checkpoint (weight norm folded at load, see `hift_weights.py`), so `hift.pt` loads
by name. The module holds no per-call state; streaming state lives in `hift_stream.py`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicertc.backends.cosyvoice.hift.conv_stft import ConvStft
from voicertc.backends.cosyvoice.hift.source import SineParams, SourceDraws, SourceModule
from voicertc.backends.cosyvoice.load.yaml_config import tag_of
from voicertc.errors import ModelDirError

logger = logging.getLogger(__name__)

HIFT_TAG = "new:cosyvoice.hifigan.generator.HiFTGenerator"
F0_TAG = "new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor"
_YAML_KEYS = (
    "in_channels", "base_channels", "nb_harmonics", "sampling_rate", "nsf_alpha", "nsf_sigma",
    "nsf_voiced_threshold", "upsample_rates", "upsample_kernel_sizes", "istft_params",
    "resblock_kernel_sizes", "resblock_dilation_sizes", "source_resblock_kernel_sizes",
    "source_resblock_dilation_sizes", "lrelu_slope", "audio_limit", "f0_predictor",
)  # fmt: skip


def _tuple2(rows: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(v) for v in row) for row in rows)


@dataclass(frozen=True)
class HiftConfig:
    """HiFT hyper-parameters, as in the cosyvoice2.yaml `hift` node."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sample_rate_hz: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold_hz: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5),) * 3
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5),) * 3
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_cond_channels: int = 512

    @staticmethod
    def full_size() -> HiftConfig:
        """The values of the released CosyVoice2-0.5B `hift`."""
        return HiftConfig()

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * self.istft_hop

    @staticmethod
    def from_yaml(node: dict[str, Any]) -> HiftConfig:
        """Reads the `hift` node of cosyvoice2.yaml (as `load_yaml` returns it)."""
        _check_yaml_node(node)
        f0 = node["f0_predictor"]
        return HiftConfig(
            in_channels=int(node["in_channels"]),
            base_channels=int(node["base_channels"]),
            nb_harmonics=int(node["nb_harmonics"]),
            sample_rate_hz=int(node["sampling_rate"]),
            nsf_alpha=float(node["nsf_alpha"]),
            nsf_sigma=float(node["nsf_sigma"]),
            nsf_voiced_threshold_hz=float(node["nsf_voiced_threshold"]),
            upsample_rates=tuple(int(v) for v in node["upsample_rates"]),
            upsample_kernel_sizes=tuple(int(v) for v in node["upsample_kernel_sizes"]),
            istft_n_fft=int(node["istft_params"]["n_fft"]),
            istft_hop=int(node["istft_params"]["hop_len"]),
            resblock_kernel_sizes=tuple(int(v) for v in node["resblock_kernel_sizes"]),
            resblock_dilation_sizes=_tuple2(node["resblock_dilation_sizes"]),
            source_resblock_kernel_sizes=tuple(int(v) for v in node["source_resblock_kernel_sizes"]),
            source_resblock_dilation_sizes=_tuple2(node["source_resblock_dilation_sizes"]),
            lrelu_slope=float(node["lrelu_slope"]),
            audio_limit=float(node["audio_limit"]),
            f0_cond_channels=int(f0["cond_channels"]),
        )


def _check_yaml_node(node: dict[str, Any]) -> None:
    where = "cosyvoice2.yaml: hift"
    if tag_of(node) != HIFT_TAG:
        raise ModelDirError(f"{where} must be !{HIFT_TAG}, got {tag_of(node)!r}")
    missing = [key for key in _YAML_KEYS if key not in node]
    if missing:
        raise ModelDirError(f"{where} is missing {', '.join(missing)}")
    f0 = node["f0_predictor"]
    if tag_of(f0) != F0_TAG or int(f0.get("num_class", 1)) != 1:
        raise ModelDirError(f"{where}.f0_predictor must be !{F0_TAG} with num_class 1")
    if int(f0.get("in_channels", node["in_channels"])) != int(node["in_channels"]):
        raise ModelDirError(f"{where}.f0_predictor.in_channels differs from {where}.in_channels")
    if int(node["sampling_rate"]) == 22050:
        raise ModelDirError(f"{where}.sampling_rate 22050 (SineGen v1) is not supported")


class Snake(nn.Module):
    """x + sin²(αx)/α with a learned per-channel α (linear scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, C, T] -> [B, C, T]
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Three residual (Snake, dilated conv, Snake, conv) pairs with 'same' padding."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()

        def conv(dilation: int) -> nn.Conv1d:
            pad = (kernel_size * dilation - dilation) // 2
            return nn.Conv1d(channels, channels, kernel_size, dilation=dilation, padding=pad)

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, C, T] -> [B, C, T]
        for conv1, conv2, act1, act2 in zip(
            self.convs1, self.convs2, self.activations1, self.activations2, strict=True
        ):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class F0Predictor(nn.Module):
    """`ConvRNNF0Predictor`: five k=3 convs with ELU, a linear head, abs -> f0 in Hz per mel frame."""

    def __init__(self, in_channels: int, cond_channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            conv_in = in_channels if i == 0 else cond_channels
            layers += [nn.Conv1d(conv_in, cond_channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: Tensor) -> Tensor:
        # mel: [B, 80, T] -> f0_hz: [B, T]
        hidden = self.condnet(mel).transpose(1, 2)
        return torch.abs(self.classifier(hidden).squeeze(-1))


class HiFTGenerator(nn.Module):
    """The CosyVoice2 HiFT vocoder (non-causal). Stateless: every call is independent."""

    stft_window: Tensor  # registered buffer

    def __init__(self, config: HiftConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.f0_predictor = F0Predictor(c.in_channels, c.f0_cond_channels)
        self.m_source = SourceModule(
            SineParams(
                sample_rate_hz=c.sample_rate_hz,
                upsample_scale=c.samples_per_frame,
                harmonics=c.nb_harmonics + 1,
                sine_amp=c.nsf_alpha,
                noise_std=c.nsf_sigma,
                voiced_threshold_hz=c.nsf_voiced_threshold_hz,
            )
        )
        stages = len(c.upsample_rates)
        channels = [c.base_channels // 2**i for i in range(stages + 1)]
        self.conv_pre = nn.Conv1d(c.in_channels, c.base_channels, 7, padding=3)
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(channels[i], channels[i + 1], k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes, strict=True))
        )
        self._build_source_fusion(channels[1:])
        self.resblocks = nn.ModuleList(
            ResBlock(channels[i + 1], k, d)
            for i in range(stages)
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = nn.Conv1d(channels[-1], c.istft_n_fft + 2, 7, padding=3)
        window = torch.hann_window(c.istft_n_fft, periodic=True, dtype=torch.float64).float()
        self.register_buffer("stft_window", window, persistent=False)
        self.decode_runner: Callable[[Tensor, Tensor], Tensor] | None = None  # `[engine] cuda_graphs`

    def _build_source_fusion(self, stage_channels: list[int]) -> None:
        """Per upsampling stage: a strided conv bringing the excitation STFT (hop istft_hop) to the
        stage's frame rate, then a ResBlock; its output is added to the stage's activations."""
        c = self.config
        rates = [1, *reversed(c.upsample_rates)][: len(stage_channels)]
        strides = list(reversed([math.prod(rates[: i + 1]) for i in range(len(rates))]))
        stft_channels = c.istft_n_fft + 2
        self.source_downs = nn.ModuleList(
            nn.Conv1d(stft_channels, ch, 1) if s == 1 else nn.Conv1d(stft_channels, ch, 2 * s, s, s // 2)
            for ch, s in zip(stage_channels, strides, strict=True)
        )
        self.source_resblocks = nn.ModuleList(
            ResBlock(ch, k, d)
            for ch, k, d in zip(
                stage_channels, c.source_resblock_kernel_sizes, c.source_resblock_dilation_sizes, strict=True
            )
        )

    def weight_normed_layers(self) -> list[str]:
        """Names of the layers whose weight the official checkpoint stores weight-normed."""
        return [
            name
            for name, module in self.named_modules()
            if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d)) and not name.startswith("source_downs")
        ]

    def f0(self, mel: Tensor) -> Tensor:
        # mel: [B, 80, T] -> f0_hz: [B, T]
        return self.f0_predictor(mel)

    def source_from_f0(self, f0_hz: Tensor, draws: SourceDraws) -> Tensor:
        # f0_hz: [B, T] -> source: [B, 1, T * 480]
        f0_up = torch.repeat_interleave(f0_hz, self.config.samples_per_frame, dim=1).unsqueeze(-1)
        return self.m_source(f0_up, draws).transpose(1, 2)

    def infer(
        self,
        mel: Tensor,
        *,
        cache_source: Tensor | None = None,
        source: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Vocode a mel; `source` injects the excitation, else it is drawn from `generator`.

        `cache_source` overwrites the first samples of the excitation (the previous chunk's tail), which
        keeps the harmonic phase continuous across streaming chunks, as the reference does.
        """
        # mel: [B, 80, T] -> wav: [B, T * 480], source: [B, 1, T * 480]
        with torch.inference_mode():
            if source is None:
                f0_hz = self.f0(mel)
                draws = SourceDraws.draw(
                    mel.shape[0], f0_hz.shape[1] * self.config.samples_per_frame,
                    self.config.nb_harmonics + 1, generator,
                )  # fmt: skip
                source = self.source_from_f0(f0_hz, draws)
            else:
                source = source.clone()
            if cache_source is not None and cache_source.shape[2] > 0:
                source[:, :, : cache_source.shape[2]] = cache_source
            return self.decode(mel, source), source

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """The generator network: through `decode_runner` (captured static steps) when one is set."""
        # mel: [B, 80, T], source: [B, 1, T * 480] -> wav: [B, T * 480]
        if self.decode_runner is not None:
            return self.decode_runner(mel, source)
        return self.decode_eager(mel, source)

    def decode_eager(self, mel: Tensor, source: Tensor, transform: ConvStft | None = None) -> Tensor:
        """The generator network; `transform` replaces torch's STFT pair (an ONNX or captured graph)."""
        stft, istft = self._stft, self._istft
        if transform is not None:
            stft, istft = transform.stft, transform.istft
        source_stft = stft(source.squeeze(1))
        x = self.conv_pre(mel)
        for i in range(len(self.ups)):
            x = self._up_stage(i, x, source_stft)
        return self._to_wav(x, istft)

    def decode_parts(self, mel: Tensor, source: Tensor) -> Generator[None, None, Tensor]:
        """`decode` one upsampling stage per `next()` (an engine unit's budget on a slow CPU): the same
        operations in the same order; the wav is the generator's return. A `decode_runner` (captured
        steps) runs whole."""
        if self.decode_runner is not None:
            return self.decode_runner(mel, source)
        source_stft = self._stft(source.squeeze(1))
        x = self.conv_pre(mel)
        for i in range(len(self.ups)):
            x = self._up_stage(i, x, source_stft)
            yield
        return self._to_wav(x, self._istft)

    def _up_stage(self, i: int, x: Tensor, source_stft: Tensor) -> Tensor:
        c = self.config
        x = self.ups[i](F.leaky_relu(x, c.lrelu_slope))
        if i == len(self.ups) - 1:
            x = F.pad(x, (1, 0), mode="reflect")
        x = x + self.source_resblocks[i](self.source_downs[i](source_stft))
        kernels = len(c.resblock_kernel_sizes)
        blocks = self.resblocks[i * kernels : (i + 1) * kernels]
        return sum(block(x) for block in blocks) / kernels

    def _to_wav(self, x: Tensor, istft: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        c = self.config
        x = self.conv_post(F.leaky_relu(x))
        bins = c.istft_n_fft // 2 + 1
        magnitude = torch.exp(x[:, :bins]).clamp(max=1e2)
        phase = torch.sin(x[:, bins:])
        wav = istft(magnitude, phase)
        return wav.clamp(-c.audio_limit, c.audio_limit)

    def _stft(self, wav: Tensor) -> Tensor:
        # wav: [B, L] -> real ‖ imag: [B, n_fft + 2, L / hop + 1]
        n_fft = self.config.istft_n_fft
        spec = torch.stft(
            wav, n_fft, self.config.istft_hop, n_fft, window=self.stft_window, return_complex=True
        )
        return torch.cat([spec.real, spec.imag], dim=1)

    def _istft(self, magnitude: Tensor, phase: Tensor) -> Tensor:
        # magnitude, phase: [B, n_fft / 2 + 1, F] -> wav: [B, (F - 1) * hop]
        n_fft = self.config.istft_n_fft
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return torch.istft(spec, n_fft, self.config.istft_hop, n_fft, window=self.stft_window)
