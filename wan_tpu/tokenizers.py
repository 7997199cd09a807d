"""An in-process T5 tokenizer for the built-in `tiny` preset (no download, no sentencepiece file).

A Unigram vocabulary of single characters (with and without the `▁` word-start marker), digits,
punctuation and a few whole words, laid out like T5's (`<pad>` = 0, `</s>` = 1, `<unk>` = 2). Text it
cannot cover (e.g. Chinese) becomes `<unk>`, which is all a random-weight model needs.
`tiny_tokenizer().save_pretrained(dir)` writes a `tokenizer/` folder that `AutoTokenizer` loads back
as the same tokenizer.
"""

from __future__ import annotations

import string

from transformers import T5TokenizerFast

_WORDS = "a an the of in on with and is are to at by from for video cat dog man woman walks runs sits".split()


def _vocab() -> list[tuple[str, float]]:
    # Unigram picks the highest-scoring split: whole words beat word-start letters beat bare letters.
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -5.0)]
    pieces += [("▁" + word, -1.0) for word in _WORDS]
    pieces += [("▁" + c, -3.0) for c in string.ascii_letters + string.digits]
    pieces += [(c, -4.0) for c in string.ascii_letters + string.digits + string.punctuation]
    return pieces


TINY_VOCAB_SIZE = len(_vocab())


def tiny_tokenizer(model_max_length: int = 512) -> T5TokenizerFast:
    """A `T5TokenizerFast` over the fixed tiny vocabulary ( `TINY_VOCAB_SIZE` ids, eos `</s>`, pad `<pad>`)."""
    return T5TokenizerFast(vocab=_vocab(), extra_ids=0, model_max_length=model_max_length)
