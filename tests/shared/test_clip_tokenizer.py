"""CLIP's BPE on the `tokenizers` library (`wan_tpu/encoders/clip_tokenizer.py`).

Reference: transformers' `CLIPTokenizer(text, add_special_tokens=False)` ids, exactly, for a small BPE
with merges saved with `save_pretrained` (read from tokenizer.json, and from vocab.json + merges.txt
alone) and for the presets' tiny byte-level tokenizer.
"""

import json
import os

import pytest
from transformers import CLIPTokenizer

from wan_tpu.encoders.clip_tokenizer import CLIPBPETokenizer, _bytes_to_unicode, tiny_clip_tokenizer, tiny_hf_clip_tokenizer
from wan_tpu.errors import WanInputError

TEXTS = ["a photo of a cat", "Stack the blocks: red at the bottom, yellow on top!!", "it's 2024   and I'll go",
         "  mixed\tWHITESPACE\nand café ünïcode", "<|startoftext|>literal specials<|endoftext|>", "", "日本語 text"]


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    alphabet = _bytes_to_unicode()
    merges = [("a", "t</w>"), ("c", "at</w>"), ("t", "h"), ("th", "e</w>"), ("o", "f</w>"), ("b", "l"), ("bl", "o")]
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges)
    folder = tmp_path_factory.mktemp("clip_tokenizer")
    tokenizer.save_pretrained(folder / "json")
    # The files of older CLIP tokenizer folders (openai/clip-vit-*): vocab.json + merges.txt, no tokenizer.json.
    os.makedirs(folder / "files")
    (folder / "files" / "vocab.json").write_text(json.dumps(vocab))
    (folder / "files" / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return folder, tokenizer


def test_tokenizer_json_equals_transformers(bpe_folder):
    folder, reference = bpe_folder
    ours = CLIPBPETokenizer.from_folder(folder / "json")
    for text in TEXTS:
        assert ours(text) == reference(text, add_special_tokens=False)["input_ids"], text
    assert any(len(ours(t)) < len(t.replace(" ", "")) for t in TEXTS)  # merges were applied


def test_vocab_and_merges_equal_transformers(bpe_folder):
    folder, reference = bpe_folder
    ours = CLIPBPETokenizer.from_folder(folder / "files")
    for text in TEXTS:
        assert ours(text) == reference(text, add_special_tokens=False)["input_ids"], text


def test_tiny_tokenizer_equals_its_transformers_twin():
    ours, reference = tiny_clip_tokenizer(), tiny_hf_clip_tokenizer()
    assert len(ours) == len(reference) == 514
    for text in TEXTS:
        assert ours(text) == reference(text, add_special_tokens=False)["input_ids"], text


def test_bad_folders_are_user_errors(tmp_path):
    with pytest.raises(WanInputError, match="neither tokenizer.json nor vocab.json"):
        CLIPBPETokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(WanInputError, match="the CLIP tokenizer cannot be read"):
        CLIPBPETokenizer.from_folder(tmp_path)
