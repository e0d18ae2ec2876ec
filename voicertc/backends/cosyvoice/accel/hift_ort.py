"""HiFT on ONNX Runtime: the decoder graph of `voicertc export onnx` behind `HiFTGenerator.infer`'s
signature, so `hift_stream_step` (mel cache, excitation cache, overlap-add) runs on it unchanged. The
excitation is built by the eager module (see `voicertc.backends.cosyvoice.accel.hift_onnx_export` for why)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import Tensor

from voicertc.backends.cosyvoice.hift.generator import HiFTGenerator
from voicertc.backends.cosyvoice.hift.source import SourceDraws

logger = logging.getLogger(__name__)


def _numpy(tensor: Tensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.detach().float().cpu().numpy())


class OnnxHift:
    """`infer(mel, cache_source=, source=, generator=)` -> (wav, source), as `HiFTGenerator.infer`."""

    def __init__(self, directory: str | Path, hift: HiFTGenerator, threads: int = 0) -> None:
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # shared CPU: no busy wait
        providers = ["CPUExecutionProvider"]
        directory = Path(directory)
        self.hift = hift
        self.config = hift.config
        self.decode_session = ort.InferenceSession(
            str(directory / "hift_decode.onnx"), options, providers=providers
        )
        logger.info("onnxruntime HiFT from %s", directory)

    def infer(
        self,
        mel: Tensor,
        *,
        cache_source: Tensor | None = None,
        source: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        # mel: [B, 80, T] -> wav: [B, T * 480], source: [B, 1, T * 480]
        if source is None:
            with torch.inference_mode():
                f0_hz = self.hift.f0(mel)
                samples = f0_hz.shape[1] * self.config.samples_per_frame
                draws = SourceDraws.draw(mel.shape[0], samples, self.config.nb_harmonics + 1, generator)
                source = self.hift.source_from_f0(f0_hz, draws).cpu()
            source = source.clone()
        else:
            source = source.detach().float().cpu().clone()
        if cache_source is not None and cache_source.shape[2] > 0:
            source[:, :, : cache_source.shape[2]] = cache_source.cpu()
        (wav,) = self.decode_session.run(["wav"], {"mel": _numpy(mel), "source": _numpy(source)})
        return torch.from_numpy(wav).to(mel.device), source.to(mel.device)
