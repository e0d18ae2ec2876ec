"""Regenerates `tests/data/cv3_long_reference.safetensors`: 30 s of CosyVoice3 audio from the official code.

    .venv/bin/python -m bench.cv3_long_reference [--peer ../shared/peer] [--site DIRS] [--out FILE]

The official `CosyVoice3Model` (the runnable tree in `../shared/peer/`, run, never copied) speaks 750
seeded speech tokens (30 s) on the golden tiny v3 weights (`../shared/golden/cv3/make_model_dir.py`),
with the golden `cv3_tts_stream` prompt, twice: streamed (`tts(stream=True)`'s token2wav loop: hops
25 + prompt pad, 50, then 100; flow and HiFT re-run over the whole history per call; the final call with
full attention) and non-streaming (one `token2wav`, `finalize=True`). The HiFT noise buffers are replaced
by seeded ones (`reference_noise`) that the test injects into ours with `hift.set_noise`.

Stored (float32 unless noted; ~1.6 MB): the inputs (`in_*`), the mel each side vocoded (`stream_mel` =
the new frames of every call, concatenated; `nonstream_mel`), `stream_chunk_samples` (int64, the PCM
each call yielded) and PCM windows of `WINDOW` samples (`*_pcm_windows` [W, WINDOW]) at
`window_starts` (int64): the first and the last window of every yielded chunk, so every chunk seam and
the end of the 30 s are compared bit-for-bit-level (1e-5) without storing the whole waveform.

The official side runs as a child process with `PYTHONPATH=<site>:<peer>/stubs:<peer>/cosyvoice-ace7c47`
(`--site`: the peer's extra packages, e.g. `/work/.peer-site` plus a directory with what the official DiT
imports on top: `pip install --no-deps --target DIR x-transformers==2.11.24 einx==0.4.3 frozendict`);
this file imports nothing of voicertc. ~80 s on 2 CPU threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
GOLDEN_V3 = Path(os.environ.get("VOICERTC_GOLDEN") or REPO.parent / "shared" / "golden") / "cv3"
OUT = REPO / "tests" / "data" / "cv3_long_reference.safetensors"
TOKENS = 750  # 30 s at 25 Hz
TOKEN_SEED = 2130
NOISE_SEED = 2131
HARMONICS = 9
WINDOW = 6000  # 0.25 s
SAMPLES_PER_TOKEN = 960


def reference_noise(samples: int, seed: int = NOISE_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """The injected HiFT buffers: `rand_ini` [1, 9] (fundamental 0) and uniform noise [1, samples, 9]."""
    generator = torch.Generator().manual_seed(seed)
    rand_ini = torch.rand(1, HARMONICS, generator=generator)
    rand_ini[:, 0] = 0
    return rand_ini, torch.rand(1, samples, HARMONICS, generator=generator)


def reference_tokens(count: int = TOKENS, seed: int = TOKEN_SEED) -> torch.Tensor:
    return torch.randint(
        0, 6561, (1, count), generator=torch.Generator().manual_seed(seed), dtype=torch.int64
    )


# ---- child: the official code --------------------------------------------------------------------------


def official_run(work: Path) -> None:
    """Runs in the peer environment: loads the tiny directory as CosyVoice3 does (flow + HiFT only)."""
    import uuid

    from cosyvoice.cli.model import CosyVoice3Model
    from hyperpyyaml import load_hyperpyyaml

    torch.set_num_threads(2)
    model_dir = work / "model_dir"
    text = (model_dir / "cosyvoice3.yaml").read_text()
    head, rest = text.split("\nllm: ", 1)
    flow_hift = "\nflow: " + rest.split("\nflow: ", 1)[1].split("\n# gan related module", 1)[0]
    configs = load_hyperpyyaml(
        head + flow_hift, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")}
    )
    empty = work / "llm_empty.pt"
    torch.save({}, empty)
    model = CosyVoice3Model(torch.nn.Module(), configs["flow"], configs["hift"], fp16=False)
    model.load(str(empty), str(model_dir / "flow.pt"), str(model_dir / "hift.pt"))
    inp = torch.load(work / "inputs.pt")
    sine_gen = model.hift.m_source.l_sin_gen
    sine_gen.rand_ini, sine_gen.sine_waves = inp["rand_ini"], inp["sine_waves"]
    prompt = (inp["in_prompt_token"], inp["in_prompt_feat"], inp["in_embedding"])
    tokens = inp["in_tokens"][0].tolist()

    vocoded: list[torch.Tensor] = []
    hift_inference = model.hift.inference

    def recording(speech_feat, finalize=True):
        vocoded.append(speech_feat.clone())
        return hift_inference(speech_feat=speech_feat, finalize=finalize)

    model.hift.inference = recording

    def call(upto: int, offset: int, key: str, **kw) -> torch.Tensor:
        token = torch.tensor(tokens[:upto]).unsqueeze(0)
        return model.token2wav(token, *prompt, token_offset=offset, uuid=key, **kw)

    with torch.inference_mode():
        # streamed: CosyVoice2Model.tts(stream=True)'s loop with every token already there
        key = str(uuid.uuid1())
        model.hift_cache_dict[key] = None
        model.token_hop_len = 25
        pad = -(-prompt[0].shape[1] // 25) * 25 - prompt[0].shape[1]
        offset, pcm, mel_new = 0, [], []
        while True:
            hop = model.token_hop_len + pad if offset == 0 else model.token_hop_len
            if len(tokens) - offset < hop + model.flow.pre_lookahead_len:
                break
            pcm.append(
                call(offset + hop + model.flow.pre_lookahead_len, offset, key, stream=True, finalize=False)
            )
            mel_new.append(vocoded[-1][:, :, sum(m.shape[2] for m in mel_new) :])
            offset += hop
            model.token_hop_len = min(
                model.token_max_hop_len, model.token_hop_len * model.stream_scale_factor
            )
        pcm.append(call(len(tokens), offset, key, finalize=True))
        mel_new.append(vocoded[-1][:, :, sum(m.shape[2] for m in mel_new) :])
        # non-streaming: one call
        key = str(uuid.uuid1())
        model.hift_cache_dict[key] = None
        whole = call(len(tokens), 0, key, finalize=True, stream=False)
    torch.save(
        {"stream_pcm": pcm, "stream_mel": torch.cat(mel_new, dim=2), "nonstream_pcm": whole,
         "nonstream_mel": vocoded[-1]},
        work / "official.pt",
    )  # fmt: skip


# ---- parent ---------------------------------------------------------------------------------------------


def window_starts(chunk_samples: list[int]) -> list[int]:
    """The first and the last `WINDOW` samples of every chunk (chunks are longer than 2 windows)."""
    starts, at = [], 0
    for n in chunk_samples:
        starts += [at, at + n - WINDOW]
        at += n
    return starts


def build(peer: Path, site: str, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file, save_file

    work = Path(tempfile.mkdtemp(prefix="cv3_long_ref_"))
    model_dir = work / "model_dir"
    (model_dir / "CosyVoice-BlankEN").mkdir(parents=True)
    for name in ("cosyvoice3.yaml", "CosyVoice-BlankEN/config.json"):
        (model_dir / name).write_bytes((GOLDEN_V3 / "model_dir" / name).read_bytes())
    make = [sys.executable, str(GOLDEN_V3 / "make_model_dir.py"), str(model_dir), "--from", str(GOLDEN_V3)]
    subprocess.run(make, check=True, capture_output=True)
    golden = load_file(GOLDEN_V3 / "cv3_tts_stream.safetensors")
    rand_ini, sine_waves = reference_noise(TOKENS * SAMPLES_PER_TOKEN)
    inputs = {
        "in_prompt_token": golden["in_prompt_token"],
        "in_prompt_feat": golden["in_prompt_feat"],
        "in_embedding": golden["in_embedding"],
        "in_tokens": reference_tokens().to(torch.int32),
    }
    torch.save({**inputs, "rand_ini": rand_ini, "sine_waves": sine_waves}, work / "inputs.pt")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([site, str(peer / "stubs"), str(peer / "cosyvoice-ace7c47")])
    subprocess.run([sys.executable, __file__, "--official", str(work)], check=True, env=env)
    official = torch.load(work / "official.pt")
    chunk_samples = [int(p.shape[1]) for p in official["stream_pcm"]]
    starts = window_starts(chunk_samples)
    stream_pcm = torch.cat(official["stream_pcm"], dim=1)[0]
    whole_pcm = official["nonstream_pcm"][0]
    record = {
        **inputs,
        "stream_mel": official["stream_mel"].contiguous(),
        "nonstream_mel": official["nonstream_mel"].contiguous(),
        "stream_chunk_samples": torch.tensor(chunk_samples, dtype=torch.int64),
        "window_starts": torch.tensor(starts, dtype=torch.int64),
        "stream_pcm_windows": torch.stack([stream_pcm[s : s + WINDOW] for s in starts]),
        "nonstream_pcm_windows": torch.stack([whole_pcm[s : s + WINDOW] for s in starts]),
    }
    info = {
        "token_seed": TOKEN_SEED,
        "noise_seed": NOISE_SEED,
        "tokens": TOKENS,
        "window": WINDOW,
        "official": "FunAudioLLM/CosyVoice ace7c47 (../shared/peer)",
        "torch": torch.__version__,
        "threads": 2,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(record, str(out), metadata={"info": json.dumps(info)})
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer", type=Path, default=REPO.parent / "shared" / "peer")
    parser.add_argument("--site", default=os.environ.get("PEER_SITE", "/work/.peer-site"))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--official", type=Path, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.official is not None:
        official_run(args.official)
        return
    record = build(args.peer, args.site, args.out)
    samples = record["stream_chunk_samples"].tolist()
    sys.stdout.write(f"wrote {args.out}: chunks {samples} ({sum(samples)} samples)\n")


if __name__ == "__main__":
    main()
