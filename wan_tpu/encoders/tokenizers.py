"""Tokenizers without transformers: UMT5's from a `tokenizer/` folder, and the in-process tiny ones.

    tokenizer = UMT5Tokenizer.from_folder("Wan2.1-T2V-1.3B-Diffusers/tokenizer")
    input_ids, attention_mask = tokenizer(["a cat walks"])     # (B, 512) int32 each, padded and truncated

`UMT5Tokenizer` runs the folder's `tokenizer.json` with the `tokenizers` library, padded to and
truncated at `max_length` as transformers' `AutoTokenizer(...)(texts, padding="max_length",
max_length=512, truncation=True)` pads and truncates it (the last id of a truncated prompt is a token,
not `</s>`). A folder with only a sentencepiece `spiece.model` falls back to transformers' AutoTokenizer.

The tiny T5 tokenizer of the `tiny` preset: a Unigram vocabulary of single characters (with and
without the `▁` word-start marker), digits, punctuation and a few whole words, laid out like T5's
(`<pad>` = 0, `</s>` = 1, `<unk>` = 2). Text it cannot cover (e.g. Chinese) becomes `<unk>`, which is
all a random-weight model needs. `tiny_tokenizer()` builds it with `tokenizers` alone, as transformers'
`T5TokenizerFast(vocab=...)` builds it; `tiny_hf_tokenizer()` is that transformers tokenizer, whose
`save_pretrained(dir)` writes a `tokenizer/` folder that `AutoTokenizer` (and `UMT5Tokenizer`) load back.
"""

from __future__ import annotations

import json
import os
import string

import numpy as np

from wan_tpu.errors import WanInputError

_WORDS = "a an the of in on with and is are to at by from for video cat dog man woman walks runs sits".split()


def _vocab() -> list[tuple[str, float]]:
    # Unigram picks the highest-scoring split: whole words beat word-start letters beat bare letters.
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -5.0)]
    pieces += [("▁" + word, -1.0) for word in _WORDS]
    pieces += [("▁" + c, -3.0) for c in string.ascii_letters + string.digits]
    pieces += [(c, -4.0) for c in string.ascii_letters + string.digits + string.punctuation]
    return pieces


TINY_VOCAB_SIZE = len(_vocab())


class UMT5Tokenizer:
    """`tokenizer(texts) -> (input_ids, attention_mask)`, (B, max_length) int32, on a `tokenizers.Tokenizer`."""

    def __init__(self, backend, max_length: int = 512, pad_token: str = "<pad>"):
        pad_id = backend.token_to_id(pad_token)
        if pad_id is None:
            raise WanInputError(f"the tokenizer has no pad token {pad_token!r}; pass the tokenizer/ folder of a Wan checkpoint")
        backend.enable_truncation(max_length, stride=0, strategy="longest_first", direction="right")
        backend.enable_padding(direction="right", pad_id=pad_id, pad_type_id=0, pad_token=pad_token, length=max_length)
        self.backend, self.max_length, self.pad_token_id = backend, max_length, pad_id

    @classmethod
    def from_folder(cls, folder, max_length: int = 512):
        """A diffusers `tokenizer/` folder: its tokenizer.json, else (spiece.model only) transformers' AutoTokenizer."""
        folder = os.fspath(folder)
        if os.path.isfile(os.path.join(folder, "tokenizer.json")):
            from tokenizers import Tokenizer

            try:
                backend = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
            except Exception as e:  # noqa: BLE001 - the library raises bare Exceptions on bad files
                raise WanInputError(f"{folder}/tokenizer.json cannot be read ({e}); re-download the tokenizer") from None
            return cls(backend, max_length, _pad_token(folder))
        if os.path.isfile(os.path.join(folder, "spiece.model")):
            return TransformersTokenizer(folder, max_length)
        raise WanInputError(f"tokenizer folder {folder!r} has no tokenizer.json (nor spiece.model); pass the tokenizer/ "
                            "folder of a diffusers-format Wan checkpoint")

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=True)
        ids = np.array([e.ids for e in encodings], np.int32).reshape(len(encodings), self.max_length)
        mask = np.array([e.attention_mask for e in encodings], np.int32).reshape(len(encodings), self.max_length)
        return ids, mask


class TransformersTokenizer:
    """transformers' AutoTokenizer behind `UMT5Tokenizer`'s call (sentencepiece-only folders)."""

    def __init__(self, folder: str, max_length: int = 512):
        from transformers import AutoTokenizer

        self.tokenizer, self.max_length = AutoTokenizer.from_pretrained(folder), max_length

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        out = self.tokenizer(list(texts), padding="max_length", max_length=self.max_length, truncation=True,
                             add_special_tokens=True, return_attention_mask=True, return_tensors="np")
        return out["input_ids"].astype(np.int32), out["attention_mask"].astype(np.int32)


def _pad_token(folder: str) -> str:
    """The pad token tokenizer_config.json names (T5: `<pad>`)."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            token = json.load(f).get("pad_token", "<pad>")
    except (OSError, json.JSONDecodeError):
        return "<pad>"
    return token["content"] if isinstance(token, dict) else token or "<pad>"


def _tiny_backend():
    """The `tokenizers.Tokenizer` that transformers' `T5TokenizerFast(vocab=_vocab(), extra_ids=0)` builds."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram

    backend = Tokenizer(Unigram(_vocab(), unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)])
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<pad>", "</s>", "<unk>")])
    backend.post_processor = processors.TemplateProcessing(single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"],
                                                           special_tokens=[("</s>", 1)])
    return backend


def tiny_tokenizer(model_max_length: int = 512) -> UMT5Tokenizer:
    """The tiny T5 tokenizer ( `TINY_VOCAB_SIZE` ids, eos `</s>`, pad `<pad>`), without transformers."""
    return UMT5Tokenizer(_tiny_backend(), model_max_length)


def tiny_hf_tokenizer(model_max_length: int = 512):
    """The same tokenizer as transformers' `T5TokenizerFast`, for writing `tokenizer/` folders (`save_pretrained`)."""
    from transformers import T5TokenizerFast

    return T5TokenizerFast(vocab=_vocab(), extra_ids=0, model_max_length=model_max_length)
