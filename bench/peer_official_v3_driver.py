"""The official CosyVoice3 streaming token2wav loop, timed per chunk (the peer side of
`bench.peer_official --version 3`; imports nothing of voicertc).

    PYTHONPATH=<site>:<peer>/stubs:<peer>/cosyvoice-ace7c47 python bench/peer_official_v3_driver.py \\
        MODEL_DIR INPUTS N_TOKENS RUNS OUT_JSON [DUMP_PT|-]

Same arguments, JSON and dump as the peer tree's `official_t2w.py` (CosyVoice2 only), for
`CosyVoice3Model` (`cosyvoice/cli/model.py` of the peer tree, run, never copied): the model directory's
`cosyvoice3.yaml` cut to its header + `flow:` + `hift:` blocks, an empty LLM, `flow.pt` / `hift.pt`
through its own `load()`. `FP16=1`: its fp16 path. It picks CUDA whenever it sees one.

Per utterance, the calls `CosyVoice2Model.tts(stream=True)` (which `CosyVoice3Model` inherits) makes
once every speech token is there (no LLM thread, no 0.1 s sleeps): `token2wav(tokens[:offset + hop + 3],
token_offset=offset, stream=True, finalize=False)` while at least hop + lookahead tokens remain past the
offset (hop: 25 + the prompt pad first, then doubled up to 100), then one `token2wav(all tokens,
token_offset=offset, finalize=True)` (stream left False: full attention). `token_hop_len` lives on the
model and tts() never resets it, so it is set back to 25 before each utterance (what a fresh model does).
Each call is timed up to its PCM on the host (`.cpu()`). Every call's flow mel is recorded; the dump
keeps the new frames of each (`mel[:, :, token_mel_ratio * offset:]`).

One untimed 250-token utterance first, then RUNS timed ones; torch's global RNG seeded with 1234 before
each; 2 CPU threads.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

SEED = 1234
THREADS = 2
WARMUP_TOKENS = 250
FIRST_HOP_TOKENS = 25  # CosyVoice2Model.__init__'s token_hop_len


@dataclass
class Prompt:
    """The flow prompt of the seeded inputs: tokens [1, p], mel [1, 2p, 80], embedding [1, 192]."""

    tokens: torch.Tensor
    feat: torch.Tensor
    embedding: torch.Tensor


@dataclass
class Utterance:
    chunks: list[dict[str, object]] = field(default_factory=list)
    pcm: list[torch.Tensor] = field(default_factory=list)
    mels: list[torch.Tensor] = field(default_factory=list)  # new frames of each call


def load_official(model_dir: Path, fp16: bool):  # -> cosyvoice.cli.model.CosyVoice3Model
    from cosyvoice.cli.model import CosyVoice3Model
    from hyperpyyaml import load_hyperpyyaml

    text = (model_dir / "cosyvoice3.yaml").read_text()
    head, rest = text.split("\nllm: ", 1)  # the llm block needs Qwen weights; gan/data are training-only
    flow_hift = "\nflow: " + rest.split("\nflow: ", 1)[1].split("\n# gan related module", 1)[0]
    configs = load_hyperpyyaml(
        head + flow_hift, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")}
    )
    empty_llm = Path(tempfile.mkdtemp()) / "llm_empty.pt"
    torch.save({}, empty_llm)  # an empty module + state dict pass load()'s strict LLM load
    model = CosyVoice3Model(torch.nn.Module(), configs["flow"], configs["hift"], fp16=fp16)
    model.load(str(empty_llm), str(model_dir / "flow.pt"), str(model_dir / "hift.pt"))
    return model


def record_flow_mels(model) -> list[torch.Tensor]:
    """Every later `flow.inference` call appends its mel [1, 80, F] to the returned list."""
    mels: list[torch.Tensor] = []
    inference = model.flow.inference

    def recording(*args, **kwargs):
        out = inference(*args, **kwargs)
        mels.append(out[0])
        return out

    model.flow.inference = recording
    return mels


def timed_call(model, tokens: list[int], upto: int, offset: int, key: str, prompt: Prompt, **kw) -> tuple:
    """One `token2wav` call on tokens[:upto]: (pcm [1, S] on the host, seconds)."""
    started = time.perf_counter()
    token = torch.tensor(tokens[:upto]).unsqueeze(dim=0)
    pcm = model.token2wav(
        token=token, prompt_token=prompt.tokens, prompt_feat=prompt.feat, embedding=prompt.embedding,
        token_offset=offset, uuid=key, **kw,
    ).cpu()  # fmt: skip
    return pcm, time.perf_counter() - started


def one_utterance(model, mels: list[torch.Tensor], tokens: list[int], prompt: Prompt) -> Utterance:
    """The streamed calls of the module docstring, each timed; returns them with the new mel frames."""
    model.token_hop_len = FIRST_HOP_TOKENS
    key = str(uuid.uuid1())
    with model.lock:
        model.tts_speech_token_dict[key], model.llm_end_dict[key] = list(tokens), True
        model.hift_cache_dict[key] = None
    torch.manual_seed(SEED)
    mels.clear()
    lookahead = model.flow.pre_lookahead_len
    pad_tokens = -prompt.tokens.shape[1] % model.token_hop_len  # the prompt + first hop: whole hops
    utterance, offset = Utterance(), 0
    while True:
        hop = model.token_hop_len + pad_tokens if offset == 0 else model.token_hop_len
        if len(tokens) - offset < hop + lookahead:
            break
        pcm, seconds = timed_call(
            model, tokens, offset + hop + lookahead, offset, key, prompt, stream=True, finalize=False
        )
        _keep(
            model, utterance, mels, pcm, seconds, tokens_in=offset + hop + lookahead, offset=offset, hop=hop
        )
        offset += hop
        model.token_hop_len = min(model.token_max_hop_len, model.token_hop_len * model.stream_scale_factor)
    pcm, seconds = timed_call(model, tokens, len(tokens), offset, key, prompt, finalize=True)
    _keep(
        model, utterance, mels, pcm, seconds, tokens_in=len(tokens), offset=offset, hop=len(tokens) - offset
    )
    utterance.chunks[-1]["final"] = True
    with model.lock:
        for per_utterance in (model.tts_speech_token_dict, model.llm_end_dict, model.hift_cache_dict):
            per_utterance.pop(key)
    return utterance


def _keep(
    model, utterance: Utterance, mels: list[torch.Tensor], pcm: torch.Tensor, seconds: float, **chunk
) -> None:
    """Record one call: its timing, its PCM and the new frames of the mel its flow call made."""
    utterance.chunks.append({**chunk, "samples": int(pcm.shape[1]), "ms": 1e3 * seconds})
    utterance.pcm.append(pcm)
    utterance.mels.append(mels[-1][:, :, model.flow.token_mel_ratio * int(chunk["offset"]) :])


def main(argv: list[str]) -> None:
    model_dir, inputs_path, n_tokens, runs, out_json, *rest = argv
    n_tokens, runs, dump = int(n_tokens), int(runs), rest[0] if rest and rest[0] != "-" else None
    torch.set_num_threads(THREADS)
    model = load_official(Path(model_dir), fp16=os.environ.get("FP16") == "1")
    mels = record_flow_mels(model)
    inputs = torch.load(inputs_path)
    prompt = Prompt(inputs["prompt_tokens"], inputs["prompt_feat"], inputs["embedding"])
    tokens = inputs["tokens"][0].tolist()
    results, last = [], Utterance()
    with torch.inference_mode():
        one_utterance(model, mels, tokens[:WARMUP_TOKENS], prompt)  # untimed: allocator, oneDNN primitives
        for _ in range(runs):
            last = one_utterance(model, mels, tokens[:n_tokens], prompt)
            total_ms = sum(float(c["ms"]) for c in last.chunks)  # type: ignore[arg-type]
            samples = sum(int(p.shape[1]) for p in last.pcm)
            results.append({"chunks": last.chunks, "total_ms": total_ms, "samples": samples})
    record = {"side": "official", "model": "CosyVoice3Model", "n_tokens": n_tokens, "runs": results,
              "torch": torch.__version__, "threads": torch.get_num_threads()}  # fmt: skip
    Path(out_json).write_text(json.dumps(record, indent=1))
    if dump:
        torch.save({"pcm": torch.cat(last.pcm, dim=1)[0], "mels": last.mels}, dump)
    sys.stdout.write(f"official v3 {n_tokens} tokens: {[round(r['total_ms']) for r in results]} ms\n")


if __name__ == "__main__":
    main(sys.argv[1:])
