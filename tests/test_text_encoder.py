"""UMT5 through torchax (`wan_tpu/text_encoder.py`) and the tiny tokenizer (`wan_tpu/tokenizers.py`).

References: diffusers' `WanPipeline._get_t5_prompt_embeds` and eager transformers `UMT5EncoderModel`,
float32, on a tiny random encoder saved with `save_pretrained` plus the in-process tokenizer.
"""

import hashlib
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import WanPipeline
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from wan_tpu import torchax_compat
from wan_tpu.errors import WanInputError
from wan_tpu.text_encoder import WAN_NEGATIVE_PROMPT, UMT5TextEncoder, prompt_clean
from wan_tpu.tokenizers import TINY_VOCAB_SIZE, tiny_tokenizer

TOL = 1e-5  # float32, absolute on O(1) hidden states

PROMPTS = [
    "A cat walks on the grass, 4k video.",
    "",
    "  a   &amp;lt;dog&amp;gt;\n\t sits  ",  # HTML unescaped twice, whitespace collapsed
    "x y " * 300,  # longer than 512 tokens: truncated, ends without </s>
    WAN_NEGATIVE_PROMPT,
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    torch.manual_seed(0)
    config = UMT5Config(
        vocab_size=TINY_VOCAB_SIZE,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu",
    )
    UMT5EncoderModel(config).save_pretrained(root / "text_encoder")
    tiny_tokenizer().save_pretrained(root / "tokenizer")
    return root


@pytest.fixture(scope="module")
def encoder(checkpoint):
    return UMT5TextEncoder.from_pretrained(
        checkpoint / "text_encoder", checkpoint / "tokenizer", dtype=jnp.float32
    )


def reference_pipeline(checkpoint):
    return SimpleNamespace(
        tokenizer=AutoTokenizer.from_pretrained(checkpoint / "tokenizer"),
        text_encoder=UMT5EncoderModel.from_pretrained(checkpoint / "text_encoder").eval(),
    )


def test_matches_diffusers_prompt_embeds(checkpoint, encoder):
    with torch.no_grad():
        ref = WanPipeline._get_t5_prompt_embeds(
            reference_pipeline(checkpoint),
            PROMPTS,
            max_sequence_length=512,
            device=torch.device("cpu"),
            dtype=torch.float32,
        ).numpy()
    out = np.asarray(encoder.encode(PROMPTS))
    assert out.shape == (len(PROMPTS), 512, 32) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref, atol=TOL)
    _, mask = encoder.tokenize(PROMPTS)
    lengths = mask.sum(axis=1)
    assert lengths[1] == 1 and lengths[3] == 512  # "" is just </s>; the long prompt is truncated
    for row, length in zip(out, lengths):
        assert not row[length:].any()  # zero-padded past the prompt's true length


def test_sharded_over_a_mesh_matches_unsharded(checkpoint, encoder):
    from wan_tpu.mesh import make_mesh

    mesh = make_mesh(dp=1, sp=2, tp=4)
    sharded = UMT5TextEncoder.from_pretrained(
        checkpoint / "text_encoder", checkpoint / "tokenizer", dtype=jnp.float32, mesh=mesh
    )
    q = sharded.state["encoder.block.0.layer.0.SelfAttention.q.weight"]
    assert len(q.sharding.device_set) == 8 and not q.sharding.is_fully_replicated
    assert sharded.state["shared.weight"] is sharded.state["encoder.embed_tokens.weight"]  # tied, placed once
    np.testing.assert_allclose(np.asarray(sharded.encode(PROMPTS[:2])), np.asarray(encoder.encode(PROMPTS[:2])), atol=TOL)


def test_bfloat16_matches_diffusers(checkpoint):
    encoder = UMT5TextEncoder.from_pretrained(checkpoint / "text_encoder", checkpoint / "tokenizer", dtype=jnp.bfloat16)
    reference = reference_pipeline(checkpoint)
    reference.text_encoder.to(torch.bfloat16)
    with torch.no_grad():
        ref = WanPipeline._get_t5_prompt_embeds(
            reference, PROMPTS[:2], max_sequence_length=512, device=torch.device("cpu"), dtype=torch.bfloat16
        )
    out = encoder.encode(PROMPTS[:2])
    assert out.dtype == jnp.bfloat16
    # bfloat16 rounding (8 bits of mantissa); our attention accumulates in float32, torch's in bfloat16.
    np.testing.assert_allclose(np.asarray(out, np.float32), ref.float().numpy(), atol=5e-2)


def test_umt5_through_torchax_matches_eager(checkpoint, encoder):
    """The raw encoder (no trimming) with a padding mask, jitted as one computation."""
    model = reference_pipeline(checkpoint).text_encoder
    input_ids, mask = encoder.tokenize(PROMPTS[:3])
    with torch.no_grad():
        ref = model(torch.from_numpy(input_ids).long(), torch.from_numpy(mask).long()).last_hidden_state.numpy()
    forward = jax.jit(
        lambda state, ids, mask: torchax_compat.functional_call(
            encoder.model, state, (ids, mask), output=lambda out: out.last_hidden_state
        )
    )
    np.testing.assert_allclose(np.asarray(forward(encoder.state, input_ids, mask)), ref, atol=TOL)


def test_compiled_once_per_batch_size(encoder):
    encoder.encode(["a cat", "a dog"])
    before = encoder._forward._cache_size()
    encoder.encode(["the man walks", ""])
    assert encoder._forward._cache_size() == before
    encoder.encode(["a cat"])
    assert encoder._forward._cache_size() == before + 1


def test_prompt_clean_matches_diffusers():
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean as diffusers_prompt_clean

    for prompt in PROMPTS + ["\u3000 full\u2003width\u00a0spaces \u200b", "&#x27;quoted&#x27;"]:
        assert prompt_clean(prompt) == diffusers_prompt_clean(prompt)


def test_negative_prompt_is_the_official_one():
    # SHA-256 of `sample_neg_prompt` in the official Wan repo's wan/configs/shared_config.py (UTF-8).
    digest = hashlib.sha256(WAN_NEGATIVE_PROMPT.encode()).hexdigest()
    assert digest == "ce96e0324e4b54ce4b6e867f669ca520952e1a34cc116543516b1897f0d3c47e"


def test_tiny_tokenizer_round_trips(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == TINY_VOCAB_SIZE
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2)
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        assert loaded(prompt).input_ids == ids and ids[-1] == 1
    assert tokenizer.unk_token_id not in tokenizer("A cat walks on the grass, 4k video.").input_ids


def test_missing_folder_is_a_user_error(tmp_path, checkpoint):
    with pytest.raises(WanInputError, match="text_encoder folder .* has no config.json"):
        UMT5TextEncoder.from_pretrained(tmp_path, checkpoint / "tokenizer")
    with pytest.raises(WanInputError, match="tokenizer folder .* has no tokenizer_config.json"):
        UMT5TextEncoder.from_pretrained(checkpoint / "text_encoder", tmp_path)
    encoder = UMT5TextEncoder.from_pretrained(checkpoint / "text_encoder", checkpoint / "tokenizer")
    for prompts in ("a cat", []):
        with pytest.raises(WanInputError, match="non-empty list of prompts"):
            encoder.encode(prompts)
