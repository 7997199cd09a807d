"""CLIP's byte-level BPE tokenizer on the `tokenizers` library (no transformers), and the tiny one of the presets.

    tokenizer = CLIPBPETokenizer.from_folder("ckpt/tokenizer")
    ids = tokenizer("pick up the cup")      # BPE ids, no start/end tokens (the caller frames them)

A folder's `tokenizer.json` (or `vocab.json` + `merges.txt`) runs as transformers' `CLIPTokenizer` runs
it: NFC, whitespace runs to one space, lower case, CLIP's split pattern, byte-level BPE with `</w>` ends,
so the ids equal `CLIPTokenizer(text, add_special_tokens=False)["input_ids"]`. `tiny_clip_tokenizer()`
is CLIP's byte alphabet with no merges (514 ids); `tiny_hf_clip_tokenizer()` is the same as a
transformers tokenizer, whose `save_pretrained(dir)` writes a `tokenizer/` folder (converters, tests).
"""

from __future__ import annotations

import json
import os

from wan_tpu.errors import WanInputError

# transformers' `CLIPTokenizer` pre-tokenizer: special tokens, contractions, letter runs, single digits, other runs.
_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
SPECIAL = ("<|startoftext|>", "<|endoftext|>")


def clip_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """The `tokenizers.Tokenizer` that transformers' `CLIPTokenizer(vocab=..., merges=...)` builds."""
    from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    backend = Tokenizer(BPE(vocab=vocab, merges=list(merges), dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="</w>", fuse_unk=False, unk_token=SPECIAL[1]))
    backend.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                               normalizers.Lowercase()])
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    return backend


class CLIPBPETokenizer:
    """`tokenizer(text) -> list[int]`: CLIP's BPE ids of `text`, without start/end tokens."""

    def __init__(self, backend):
        self.backend = backend

    @classmethod
    def from_folder(cls, folder) -> CLIPBPETokenizer:
        from tokenizers import Tokenizer

        folder = os.fspath(folder)
        files = [os.path.join(folder, n) for n in ("tokenizer.json", "vocab.json", "merges.txt")]
        try:
            if os.path.isfile(files[0]):
                return cls(Tokenizer.from_file(files[0]))
            if os.path.isfile(files[1]) and os.path.isfile(files[2]):
                with open(files[1], encoding="utf-8") as f:
                    vocab = json.load(f)
                with open(files[2], encoding="utf-8") as f:
                    merges = [tuple(line.split()) for line in f.read().split("\n") if line and not line.startswith("#version")]
                return cls(clip_bpe(vocab, merges))
        except Exception as e:  # noqa: BLE001 - the library raises bare Exceptions on bad files
            raise WanInputError(f"{folder}: the CLIP tokenizer cannot be read ({str(e)[:200]}); re-download or re-convert it") from None
        raise WanInputError(f"tokenizer folder {folder!r} has neither tokenizer.json nor vocab.json + merges.txt; pass the "
                            "tokenizer/ folder of the checkpoint")

    def __call__(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def _bytes_to_unicode() -> list[str]:
    """CLIP's byte-level alphabet: the 256 byte values as printable characters, in CLIP's id order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    order = printable + [b for b in range(256) if b not in printable]
    return [chars[b] for b in order]


def _tiny_vocab() -> dict[str, int]:
    alphabet = _bytes_to_unicode()
    return {t: i for i, t in enumerate(alphabet + [c + "</w>" for c in alphabet] + list(SPECIAL))}


def tiny_clip_tokenizer() -> CLIPBPETokenizer:
    """CLIP's byte alphabet and no merges (514 ids; start/end of text last): every text tokenizes, one id
    per character, which is all a random-weight model needs."""
    return CLIPBPETokenizer(clip_bpe(_tiny_vocab(), []))


def tiny_hf_clip_tokenizer():
    """`tiny_clip_tokenizer` as transformers' `CLIPTokenizer`, for writing `tokenizer/` folders."""
    from transformers import CLIPTokenizer

    return CLIPTokenizer(vocab=_tiny_vocab(), merges=[])
