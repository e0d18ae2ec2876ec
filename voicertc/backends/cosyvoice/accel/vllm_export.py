"""`voicertc export vllm MODEL_DIR OUT`: the CosyVoice2 speech LLM as a Hugging Face causal LM.

The layout CosyVoice's own vLLM export writes (cosyvoice.md §3.5): the Qwen2 body of `llm.pt`,
input embeddings <- `speech_embedding` [6564, H], `lm_head` <- `llm_decoder` with its bias,
`vocab_size` 6564, untied, no bos/eos, architecture `CosyVoice2ForCausalLM`. Text never enters through
ids: a prompt is passed as embeddings ([sos, text, task_id, prompt speech], built by our `Qwen2LM`), and
each generated speech id feeds back through the speech embedding, exactly as our decode loop does.

OUT holds `config.json`, `model.safetensors`, `generation_config.json` and `modeling_cosyvoice2.py`
(the architecture, for `trust_remote_code`); `load_exported` loads it without remote code. The dtype is
float32 by default (bit-faithful; a vLLM runner casts at load), or bfloat16 as the reference writes it.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.llm.vllm.hf_model import ARCHITECTURE
from voicertc.backends.cosyvoice.load.files import DTYPES

logger = logging.getLogger(__name__)

MODELING_FILE = "modeling_cosyvoice2.py"
DROPPED_CONFIG_KEYS = ("bos_token_id", "eos_token_id", "architectures", "transformers_version", "auto_map")


def exported_config(qwen2: dict[str, Any], vocab_size: int, dtype: str) -> dict[str, Any]:
    """The backbone's config.json turned into the exported model's (speech vocabulary, biased head)."""
    config = {k: v for k, v in qwen2.items() if k not in DROPPED_CONFIG_KEYS}
    config.update(
        architectures=[ARCHITECTURE],
        model_type="qwen2",
        vocab_size=vocab_size,
        tie_word_embeddings=False,
        torch_dtype=dtype,
        auto_map={"AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.{ARCHITECTURE}"},
    )
    return config


def exported_state_dict(llm_state: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """`Qwen2LM` keys -> `CosyVoice2ForCausalLM` keys; the text embedding and Qwen's own head dropped."""
    out: dict[str, Tensor] = {}
    for key, value in llm_state.items():
        if key.startswith("llm.model.model.") and not key.endswith("embed_tokens.weight"):
            out[key[len("llm.model.") :]] = value
    out["model.embed_tokens.weight"] = llm_state["speech_embedding.weight"]
    out["lm_head.weight"] = llm_state["llm_decoder.weight"]
    out["lm_head.bias"] = llm_state["llm_decoder.bias"]
    return {k: v.detach().to(dtype).contiguous().clone() for k, v in out.items()}


def export_vllm(model_dir: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write the exported LLM of `model_dir` into `out` (created); returns `out`."""
    from safetensors.torch import save_file

    from voicertc.backends.cosyvoice.load.v2 import load_llm

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out)
    llm = load_llm(model_dir)
    state = exported_state_dict(llm.state_dict(), DTYPES[dtype])
    vocab = int(state["lm_head.weight"].shape[0])
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = exported_config(llm.config.qwen2, vocab, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    # no top_k/top_p here: RAS replaces the logits (our logits processor), vLLM then samples plainly
    generation = {"do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    shutil.copyfile(Path(__file__).parent.parent / "llm" / "vllm" / "hf_model.py", out / MODELING_FILE)
    logger.info("exported the CosyVoice2 LLM of %s to %s (%s, vocab %d)", model_dir, out, dtype, vocab)
    return out


def load_exported(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """The exported model as our `CosyVoice2ForCausalLM` (eval, SDPA attention), no remote code."""
    from voicertc.backends.cosyvoice.llm.vllm.hf_model import CosyVoice2ForCausalLM

    model = CosyVoice2ForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)
