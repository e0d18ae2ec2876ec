"""CosyVoice3's causal HiFT vocoder (`CausalHiFTGenerator`), run incrementally.

80-bin mel at 50 Hz -> 24 kHz waveform (480 samples per frame). Same signal path as CosyVoice2's HiFT
(f0 predictor -> NSF excitation -> STFT fused into a HiFi-GAN upsampler -> iSTFT) but every conv is
causal: conv_pre (k5) and the f0 predictor's first conv (k4) look 4 / 3 frames right, all others look
only left; the upsamplers are nearest x u + causal conv; the f0 predictor runs in float64.

Upstream re-runs the whole generator over the whole mel history for every streaming chunk. Here each
conv keeps its left context in a `HiftStreamState` (its unconsumed input frames), the excitation carries
its phase, the source STFT and the output iSTFT carry their overlap, so a chunk costs work proportional
to the chunk and produces exactly the samples the whole-history re-run would produce. `infer` is the
same code on one chunk (the reference `inference`); `finalize=False` holds back the last 8 frames as the
reference does: T frames in -> (T - 8) * 480 samples out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicertc.backends.cosyvoice.hift.generator import HiftConfig, Snake
from voicertc.backends.cosyvoice.hift.source import SineParams
from voicertc.backends.cosyvoice.hift.source_causal import CausalSourceModule, SourceState
from voicertc.backends.cosyvoice.load.yaml_config import tag_of
from voicertc.engine.parts import run_to_end
from voicertc.errors import ModelDirError

logger = logging.getLogger(__name__)

HIFT_TAG = "new:cosyvoice.hifigan.generator.CausalHiFTGenerator"
F0_TAG = "new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor"
F0_LOOKAHEAD = 3  # CausalConvRNNF0Predictor's first conv: k=4, 3 frames right
HELD_BACK_FRAMES = 8  # non-final: f0 lookahead 3 + conv_pre lookahead 4 + 1 trimmed frame


@dataclass(frozen=True)
class HiftV3Config(HiftConfig):
    conv_pre_look_right: int = 4

    @staticmethod
    def from_yaml(node: dict[str, Any]) -> HiftV3Config:
        """Reads the `hift` node of cosyvoice3.yaml (as `load_yaml` returns it)."""
        where = "cosyvoice3.yaml: hift"
        if tag_of(node) != HIFT_TAG:
            raise ModelDirError(f"{where} must be !{HIFT_TAG}, got {tag_of(node)!r}")
        f0 = node.get("f0_predictor")
        if not isinstance(f0, dict) or tag_of(f0) != F0_TAG or int(f0.get("num_class", 1)) != 1:
            raise ModelDirError(f"{where}.f0_predictor must be !{F0_TAG} with num_class 1")
        try:
            base: dict[str, Any] = {
                "in_channels": int(node.get("in_channels", 80)),
                "base_channels": int(node["base_channels"]),
                "nb_harmonics": int(node["nb_harmonics"]),
                "sample_rate_hz": int(node["sampling_rate"]),
                "nsf_alpha": float(node["nsf_alpha"]),
                "nsf_sigma": float(node["nsf_sigma"]),
                "nsf_voiced_threshold_hz": float(node["nsf_voiced_threshold"]),
                "upsample_rates": tuple(int(v) for v in node["upsample_rates"]),
                "upsample_kernel_sizes": tuple(int(v) for v in node["upsample_kernel_sizes"]),
                "istft_n_fft": int(node["istft_params"]["n_fft"]),
                "istft_hop": int(node["istft_params"]["hop_len"]),
                "resblock_kernel_sizes": tuple(int(v) for v in node["resblock_kernel_sizes"]),
                "resblock_dilation_sizes": tuple(
                    tuple(int(v) for v in r) for r in node["resblock_dilation_sizes"]
                ),
                "source_resblock_kernel_sizes": tuple(int(v) for v in node["source_resblock_kernel_sizes"]),
                "source_resblock_dilation_sizes": tuple(
                    tuple(int(v) for v in r) for r in node["source_resblock_dilation_sizes"]
                ),
                "lrelu_slope": float(node["lrelu_slope"]),
                "audio_limit": float(node["audio_limit"]),
                "f0_cond_channels": int(f0["cond_channels"]),
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelDirError(f"{where}: missing or bad value ({exc!r})") from exc
        if base["sample_rate_hz"] == 22050:
            raise ModelDirError(f"{where}.sampling_rate 22050 (SineGen v1) is not supported")
        return HiftV3Config(**base, conv_pre_look_right=int(node.get("conv_pre_look_right", 4)))


@dataclass
class HiftStreamState:
    """One stream's vocoder state (owned by one utterance; only `CausalHiFTGenerator.step` mutates it).

    Invariants: `tails[slot]` holds each conv's inputs not consumed yet (its left context), `pending`
    the not yet paired halves of each source fusion, `ola`/`env` the overlap-add sums of positions
    >= `ola_start` that later iSTFT frames still reach; `pcm` the computed samples not yet emitted."""

    mel_frames: int = 0
    emitted: int = 0
    source: SourceState = field(default_factory=SourceState)
    tails: dict[int, Tensor] = field(default_factory=dict)
    pending: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    source_samples: int = 0  # excitation samples made (or taken from an injected source)
    stft_head: Tensor | None = None  # [1, <= 8] first excitation samples, before the start padding
    stft_tail: Tensor | None = None  # [1, S] excitation samples from the next STFT window's start
    reflected: bool = False
    ola: Tensor | None = None
    env: Tensor | None = None
    ola_start: int = 0
    istft_frames: int = 0
    pcm: Tensor | None = None  # [1, N] computed, held back
    final: bool = False
    finished: bool = False
    work_frames: int = 0  # mel frames processed by this stream (per-chunk cost accounting)


class StreamConv1d(nn.Conv1d):
    """Conv1d that consumes its input incrementally: `left_pad` zeros before the first frame (causal),
    `right_pad` zeros after the last one (right lookahead, only on the final call), optional nearest
    upsampling first; unconsumed inputs wait in the state for the next call."""

    slot = -1

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        kernel: int,
        *,
        stride: int = 1,
        dilation: int = 1,
        left_pad: int = 0,
        right_pad: int = 0,
        upsample: int = 1,
    ) -> None:
        super().__init__(in_ch, out_ch, kernel, stride=stride, dilation=dilation)
        self.left_pad, self.right_pad, self.upsample = left_pad, right_pad, upsample
        self.span = dilation * (kernel - 1) + 1

    def forward(self, x: Tensor, state: HiftStreamState) -> Tensor:  # type: ignore[override]
        # x: [1, C_in, n] new input frames -> [1, C_out, m] outputs complete now
        if self.upsample > 1:
            x = x.repeat_interleave(self.upsample, dim=2)
        tail = state.tails.get(self.slot)
        if tail is None:
            tail = x.new_zeros(x.shape[0], x.shape[1], self.left_pad)
        buf = torch.cat([tail, x], dim=2) if tail.shape[2] else x
        if state.final and self.right_pad:
            buf = F.pad(buf, (0, self.right_pad))
        stride = self.stride[0]
        count = (buf.shape[2] - self.span) // stride + 1 if buf.shape[2] >= self.span else 0
        state.tails[self.slot] = buf[:, :, count * stride :]
        if count == 0:
            return x.new_zeros(x.shape[0], self.out_channels, 0)
        return super().forward(buf[:, :, : (count - 1) * stride + self.span])


def _causal(ch_in: int, ch_out: int, kernel: int, dilation: int = 1) -> StreamConv1d:
    return StreamConv1d(ch_in, ch_out, kernel, dilation=dilation, left_pad=dilation * (kernel - 1))


class CausalResBlock(nn.Module):
    """Three residual (Snake, causal dilated conv, Snake, causal conv) pairs."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(_causal(channels, channels, kernel, d) for d in dilations)
        self.convs2 = nn.ModuleList(_causal(channels, channels, kernel) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor, state: HiftStreamState) -> Tensor:
        for conv1, conv2, act1, act2 in zip(
            self.convs1, self.convs2, self.activations1, self.activations2, strict=True
        ):
            x = conv2(act2(conv1(act1(x), state)), state) + x
        return x


class CausalF0Predictor(nn.Module):
    """`CausalConvRNNF0Predictor`: conv k4 (3 right) + 4 causal k3 convs with ELU, linear, abs. float64."""

    def __init__(self, in_channels: int, cond_channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            StreamConv1d(in_channels, cond_channels, F0_LOOKAHEAD + 1, right_pad=F0_LOOKAHEAD),
            nn.ELU(),
        ]
        for _ in range(4):
            layers += [_causal(cond_channels, cond_channels, 3), nn.ELU()]
        self.condnet = nn.ModuleList(layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: Tensor, state: HiftStreamState) -> Tensor:
        # mel: [1, 80, n] float64 -> f0 [1, m] float64 for the frames complete now
        x = mel
        for layer in self.condnet:
            x = layer(x, state) if isinstance(layer, StreamConv1d) else layer(x)
        return torch.abs(self.classifier(x.transpose(1, 2)).squeeze(-1))


class CausalHiFTGenerator(nn.Module):
    """The v3 vocoder. Stateless between calls except the fixed noise buffers (`set_noise`)."""

    stft_window: Tensor  # registered buffer

    def __init__(self, config: HiftV3Config) -> None:
        super().__init__()
        c = self.config = config
        harmonics = c.nb_harmonics + 1
        self.m_source = CausalSourceModule(
            SineParams(
                sample_rate_hz=c.sample_rate_hz,
                upsample_scale=c.samples_per_frame,
                harmonics=harmonics,
                sine_amp=c.nsf_alpha,
                noise_std=c.nsf_sigma,
                voiced_threshold_hz=c.nsf_voiced_threshold_hz,
            )
        )
        look = c.conv_pre_look_right
        self.conv_pre = StreamConv1d(c.in_channels, c.base_channels, look + 1, right_pad=look)
        stages = len(c.upsample_rates)
        channels = [c.base_channels // 2**i for i in range(stages + 1)]
        self.ups = nn.ModuleList(
            StreamConv1d(channels[i], channels[i + 1], k, left_pad=k - 1, upsample=u)
            for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes, strict=True))
        )
        rates = [1, *reversed(c.upsample_rates)][:stages]
        strides = list(reversed([math.prod(rates[: i + 1]) for i in range(stages)]))
        stft_ch = c.istft_n_fft + 2
        self.source_downs = nn.ModuleList(
            StreamConv1d(stft_ch, ch, 1)
            if s == 1
            else StreamConv1d(stft_ch, ch, 2 * s, stride=s, left_pad=s - 1)
            for ch, s in zip(channels[1:], strides, strict=True)
        )
        self.source_resblocks = nn.ModuleList(
            CausalResBlock(ch, k, d)
            for ch, k, d in zip(
                channels[1:], c.source_resblock_kernel_sizes, c.source_resblock_dilation_sizes, strict=True
            )
        )
        self.resblocks = nn.ModuleList(
            CausalResBlock(channels[i + 1], k, d)
            for i in range(stages)
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = _causal(channels[-1], stft_ch, 7)
        self.f0_predictor = CausalF0Predictor(c.in_channels, c.f0_cond_channels)
        window = torch.hann_window(c.istft_n_fft, periodic=True, dtype=torch.float64).float()
        self.register_buffer("stft_window", window, persistent=False)
        # `[engine] cuda_graphs`: the synthesis after the excitation as captured steps (`captured_causal`)
        self.synthesis_runner: Callable[[Tensor, Tensor, HiftStreamState], Tensor] | None = None
        for slot, module in enumerate(m for m in self.modules() if isinstance(m, StreamConv1d)):
            module.slot = slot

    def weight_normed_layers(self) -> list[str]:
        """Names of the layers whose weight the official checkpoint stores weight-normed."""
        return [
            name
            for name, module in self.named_modules()
            if isinstance(module, nn.Conv1d) and not name.startswith("source_downs")
        ]

    def set_noise(self, rand_ini: Tensor, sine_waves: Tensor) -> None:
        """Use these fixed buffers ([1, 9] initial phase, [1, L, 9] uniform noise) from now on."""
        self.m_source.buffers_.set(rand_ini, sine_waves)

    # ---- whole call (the reference `inference`) --------------------------------------------------

    @torch.inference_mode()
    def infer(
        self, mel: Tensor, *, finalize: bool = True, source: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Vocode a whole mel; `source` [1, 1, L] injects the excitation instead of f0 + NSF.

        -> (wav [1, T*480] or [1, (T-8)*480] when not `finalize`, source [1, 1, T*480 or (T-3)*480])."""
        if mel.dim() != 3 or mel.shape[0] != 1 or mel.shape[1] != self.config.in_channels:
            raise ValueError(f"mel must have shape [1, {self.config.in_channels}, T], got {list(mel.shape)}")
        state = HiftStreamState()
        wav, used = self.step(mel, state, final=finalize, source=source)
        return wav, used

    # ---- incremental ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(
        self, mel: Tensor, state: HiftStreamState, *, final: bool, source: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The next mel frames [1, 80, n] -> (new samples [1, N], new excitation [1, 1, S]).

        After the call the stream has emitted 480 * (frames - 8) samples (all of them after `final`).
        `source` injects the excitation of the whole stream so far (e.g. the reference re-run's, which
        covers the history too); only its samples not used yet are taken."""
        return self.step_rows(mel, state, [state.source], final=final, source=source)

    @torch.inference_mode()
    def step_rows(
        self,
        mel: Tensor,
        state: HiftStreamState,
        sources: list[SourceState],
        *,
        final: bool,
        source: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """`step` on B rows [B, 80, n] that share one (batched) state, each row with its own excitation
        state `sources[b]` (`hift.causal_batch` builds and splits such states)."""
        return run_to_end(self.step_rows_parts(mel, state, sources, final=final, source=source))

    def step_rows_parts(
        self,
        mel: Tensor,
        state: HiftStreamState,
        sources: list[SourceState],
        *,
        final: bool,
        source: Tensor | None = None,
    ) -> Generator[None, None, tuple[Tensor, Tensor]]:
        """`step_rows` one part per `next()` (the excitation; the STFT and `conv_pre`; each upsampling
        stage; then `conv_post`, the iSTFT and the hold-back): the same operations in the same order; its
        result is the generator's return. `state` changes as the parts run (`hift.causal_batch` gives it
        a merged copy and writes the rows back at the end). Run each `next()` under inference mode."""
        if state.finished:
            raise ValueError("this HiFT stream is already finalized")
        state.final = final
        state.mel_frames += mel.shape[2]
        state.work_frames = mel.shape[2]
        mel = mel.float()
        excitation = self._excitation(mel, state, source, sources)  # the f0 predictor runs in float64
        yield
        if self.synthesis_runner is not None:  # the captured step (`hift.captured_causal`)
            out = self.synthesis_runner(mel, excitation, state)
        else:
            out = yield from self.synthesis_parts(mel, excitation, state)
        return out, excitation

    def synthesis_parts(
        self, mel: Tensor, excitation: Tensor, state: HiftStreamState
    ) -> Generator[None, None, Tensor]:
        """Everything after the excitation, in parts (the STFT and `conv_pre`; each upsampling stage;
        then `conv_post`, the iSTFT and the hold-back): mel [B, 80, n] float32 and the new excitation
        [B, 1, S] -> the samples ready now [B, N], clamped. `state.final` and the counters of the call
        are set already. Its shapes and branches depend on the stream's phase alone, not on absolute
        positions (`hift.captured_causal.synthesis_key`)."""
        stft = self._stft(excitation, state)
        x = self.conv_pre(mel, state)
        yield
        for i in range(len(self.ups)):
            x = self._up_stage(i, x, stft, state)
            yield
        pcm = self._istft(self.conv_post(F.leaky_relu(x), state), state)
        if state.pcm is not None:
            pcm = torch.cat([state.pcm, pcm], dim=1)
        spf = self.config.samples_per_frame
        final = state.final
        target = state.mel_frames * spf if final else max(state.mel_frames - HELD_BACK_FRAMES, 0) * spf
        ready = target - state.emitted
        out, state.pcm = pcm[:, :ready], pcm[:, ready:]
        state.emitted += out.shape[1]
        if final:
            state.finished = True
            state.tails, state.pending, state.pcm = {}, {}, None
        return out.clamp(-self.config.audio_limit, self.config.audio_limit)

    def _excitation(
        self, mel: Tensor, state: HiftStreamState, source: Tensor | None, sources: list[SourceState]
    ) -> Tensor:
        spf = self.config.samples_per_frame
        frames = state.mel_frames if state.final else max(state.mel_frames - F0_LOOKAHEAD, 0)
        if source is not None:
            new = source.reshape(1, 1, -1)[:, :, state.source_samples : frames * spf].float()
        else:
            f0 = self.f0_predictor(mel.double(), state).float()
            new = self.m_source(f0, sources)
        state.source_samples += new.shape[2]
        return new

    def _stft(self, excitation: Tensor, state: HiftStreamState) -> Tensor:
        # excitation: [1, 1, S] new samples -> real ‖ imag columns complete now [1, n_fft + 2, m]
        n_fft, hop = self.config.istft_n_fft, self.config.istft_hop
        x = excitation[:, 0]
        if state.stft_tail is None:  # the stream start is reflect-padded once enough samples exist
            if state.stft_head is not None:
                x = torch.cat([state.stft_head, x], dim=1)
            if x.shape[1] <= n_fft // 2:
                state.stft_head = x
                return x.new_zeros(x.shape[0], n_fft + 2, 0)
            x = F.pad(x[:, None], (n_fft // 2, 0), mode="reflect")[:, 0]
        else:
            x = torch.cat([state.stft_tail, x], dim=1)
        if state.final:
            x = F.pad(x[:, None], (0, n_fft // 2), mode="reflect")[:, 0]
        count = (x.shape[1] - n_fft) // hop + 1 if x.shape[1] >= n_fft else 0
        state.stft_tail = x[:, count * hop :]
        if count == 0:
            return x.new_zeros(x.shape[0], n_fft + 2, 0)
        spec = torch.stft(
            x[:, : (count - 1) * hop + n_fft], n_fft, hop, n_fft,
            window=self.stft_window, center=False, return_complex=True,
        )  # fmt: skip
        return torch.cat([spec.real, spec.imag], dim=1)

    def _paired(self, state: HiftStreamState, key: int, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """The common prefix of two streams of frames; the rest waits for the next call."""
        if key in state.pending:
            old_a, old_b = state.pending[key]
            a, b = torch.cat([old_a, a], dim=2), torch.cat([old_b, b], dim=2)
        n = min(a.shape[2], b.shape[2])
        state.pending[key] = (a[:, :, n:], b[:, :, n:])
        return a[:, :, :n], b[:, :, :n]

    def _up_stage(self, i: int, x: Tensor, stft: Tensor, state: HiftStreamState) -> Tensor:
        c = self.config
        x = self.ups[i](F.leaky_relu(x, c.lrelu_slope), state)
        if i == len(self.ups) - 1 and not state.reflected and x.shape[2] >= 2:
            x = torch.cat([x[:, :, 1:2], x], dim=2)  # ReflectionPad1d((1, 0)) at the stream start
            state.reflected = True
        si = self.source_resblocks[i](self.source_downs[i](stft, state), state)
        x, si = self._paired(state, i, x, si)
        x = x + si
        kernels = len(c.resblock_kernel_sizes)
        blocks = self.resblocks[i * kernels : (i + 1) * kernels]
        return sum(block(x, state) for block in blocks) / kernels

    def _istft(self, x: Tensor, state: HiftStreamState) -> Tensor:
        # x: [1, n_fft + 2, m] new frames -> [1, N] output samples complete now (before the hold-back)
        c = self.config
        n_fft, hop = c.istft_n_fft, c.istft_hop
        bins = n_fft // 2 + 1
        magnitude = torch.exp(x[:, :bins]).clamp(max=1e2)
        phase = torch.sin(x[:, bins:])
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        rows, m = spec.shape[0], spec.shape[2]
        if m:
            frames = torch.fft.irfft(spec, n=n_fft, dim=1) * self.stft_window[None, :, None]  # [B, n_fft, m]
        else:
            frames = x.new_zeros(rows, n_fft, 0)
        first = state.istft_frames * hop  # position of the first new frame's first sample
        end = (state.istft_frames + m - 1) * hop + n_fft if m else first + n_fft - hop
        start = state.ola_start
        ola = x.new_zeros(rows, max(end - start, 0))
        env = x.new_zeros(1, max(end - start, 0))  # the window envelope: one for every row
        if state.ola is not None:
            ola[:, : state.ola.shape[1]] = state.ola
            assert state.env is not None
            env[:, : state.env.shape[1]] = state.env
        square = self.stft_window.pow(2)
        for r in range(n_fft // hop):
            at = first + r * hop - start
            piece = frames[:, r * hop : (r + 1) * hop].transpose(1, 2).reshape(rows, m * hop)
            ola[:, at : at + m * hop] += piece
            env[:, at : at + m * hop] += square[r * hop : (r + 1) * hop].repeat(m)
        state.istft_frames += m
        done = state.istft_frames * hop if not state.final else end
        if state.final:  # torch.istft(center=True) ends n_fft // 2 before the last frame's end
            done = (state.istft_frames - 1) * hop + n_fft // 2
        cut = max(done - start, 0)
        out = ola[:, :cut] / env[:, :cut]
        skip = max(n_fft // 2 - start, 0)  # center=True drops the first n_fft // 2 positions
        state.ola, state.env, state.ola_start = ola[:, cut:], env[:, cut:], start + cut
        return out[:, skip:]


def load_hift_v3_state_dict(
    module: CausalHiFTGenerator, state_dict: dict[str, Tensor], source_name: str
) -> None:
    """Fold weight norm and load an official v3 `hift.pt` strictly; the f0 predictor is folded and kept
    in float64 (the reference converts it to float64 on its first call)."""
    from voicertc.backends.cosyvoice.hift.weights import (
        _G,
        _V,
        _official_names,
        fold_weight_norm,
        official_layout,
    )
    from voicertc.backends.cosyvoice.load.checkpoint import check_layout

    found = _official_names(state_dict)
    check_layout(found, official_layout(module), source_name, "HiFT built from cosyvoice3.yaml")  # type: ignore[arg-type]
    module.f0_predictor.double()
    folded: dict[str, Tensor] = {}
    for key, value in found.items():
        dtype = torch.float64 if key.startswith("f0_predictor.") else torch.float32
        if key.endswith(_G):
            layer = key[: -len(_G)]
            folded[layer + ".weight"] = fold_weight_norm(value.to(dtype), found[layer + _V].to(dtype))
        elif not key.endswith(_V):
            folded[key] = value.to(dtype)
    module.load_state_dict(folded, strict=True)
    module.eval()
