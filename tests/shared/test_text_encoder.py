"""Our UMT5 text encoder (`wan_tpu/encoders/umt5_text.py`, `wan_tpu/models/umt5*.py`) and tokenizers (`wan_tpu/encoders/tokenizers.py`).

References: diffusers' `WanPipeline._get_t5_prompt_embeds` over transformers' `UMT5EncoderModel` and
`AutoTokenizer`, on a tiny random encoder saved with `save_pretrained` (plus the tiny tokenizer) and
loaded through our loader. Tolerances: float32 1e-5 absolute on O(1) hidden states; bfloat16 6e-2
absolute (a few bfloat16 roundings of values up to ~4: transformers rounds each op to bfloat16, our
attention accumulates in float32). Token ids and masks: exactly equal.
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import WanPipeline
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from wan_tpu.encoders import umt5
from wan_tpu.encoders.tokenizers import TINY_VOCAB_SIZE, UMT5Tokenizer, tiny_hf_tokenizer, tiny_tokenizer
from wan_tpu.encoders.umt5_loading import load_umt5
from wan_tpu.encoders.umt5_text import UMT5TextEncoder, compile_encode
from wan_tpu.errors import WanInputError

TOL = 1e-5
BF16_TOL = 6e-2

PROMPTS = [
    "A cat walks on the grass, 4k video.",
    "",
    "  a   &amp;lt;dog&amp;gt;\n\t sits  ",  # HTML unescaped twice, whitespace collapsed
    "x y " * 300,  # longer than 512 tokens: truncated
    "色调艳丽，过曝，静态，细节模糊不清，字幕 a cat",
]
# Raw strings for the tokenizers (no cleaning): whitespace of every kind, HTML, CJK, emoji, long, empty.
TEXTS = PROMPTS + [
    " ", "\t\n", "  leading and trailing  ", "a\u3000full\u2003width\u00a0spaces\u200b", "<b>bold</b> &amp; more",
    "🐱 emoji 🐶", "ÀÉÎõü café", "x" * 2000, "The dog runs. The man sits!", "</s> <pad> <unk> literally",
]


def hf_config(**overrides):
    fields = dict(vocab_size=TINY_VOCAB_SIZE, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu")
    return UMT5Config(**{**fields, **overrides})


def save_encoder(folder, seed=0, **overrides):
    torch.manual_seed(seed)
    UMT5EncoderModel(hf_config(**overrides)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    save_encoder(root / "text_encoder")
    tiny_hf_tokenizer().save_pretrained(root / "tokenizer")
    return root


@pytest.fixture(scope="module")
def encoder(checkpoint):
    return UMT5TextEncoder.from_pretrained(checkpoint / "text_encoder", checkpoint / "tokenizer", dtype=jnp.float32)


def reference_pipeline(checkpoint, dtype=torch.float32):
    return SimpleNamespace(
        tokenizer=AutoTokenizer.from_pretrained(checkpoint / "tokenizer"),
        text_encoder=UMT5EncoderModel.from_pretrained(checkpoint / "text_encoder", dtype=dtype).eval(),
    )


def diffusers_embeds(checkpoint, prompts, dtype=torch.float32):
    with torch.no_grad():
        return WanPipeline._get_t5_prompt_embeds(reference_pipeline(checkpoint, dtype), prompts, max_sequence_length=512,
                                                 device=torch.device("cpu"), dtype=dtype).float().numpy()


def test_matches_diffusers_prompt_embeds(checkpoint, encoder):
    out = np.asarray(encoder.encode(PROMPTS))
    assert out.shape == (len(PROMPTS), 512, 32) and out.dtype == np.float32
    np.testing.assert_allclose(out, diffusers_embeds(checkpoint, PROMPTS), atol=TOL)
    _, mask = encoder.tokenize(PROMPTS)
    lengths = mask.sum(axis=1)
    assert lengths[1] == 1 and lengths[3] == 512  # "" is just </s>; the long prompt is truncated
    for row, length in zip(out, lengths):
        assert not row[length:].any()  # zero-padded past the prompt's true length


def test_bfloat16_matches_transformers_in_bfloat16(checkpoint):
    encoder = UMT5TextEncoder.from_pretrained(checkpoint / "text_encoder", checkpoint / "tokenizer", dtype=jnp.bfloat16)
    assert encoder.model.blocks.ffn.wo.weight.dtype == jnp.bfloat16  # transformers keeps `wo` float32 for float16 only
    out = encoder.encode(PROMPTS[:3])
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), diffusers_embeds(checkpoint, PROMPTS[:3], torch.bfloat16),
                               atol=BF16_TOL)


@pytest.mark.parametrize("feed_forward_proj", ["relu", "gated-relu", "gelu"])
def test_other_feed_forwards_match_transformers(tmp_path, feed_forward_proj):
    """The raw encoder (no trimming) with a padding mask, as transformers runs it."""
    save_encoder(tmp_path, seed=1, feed_forward_proj=feed_forward_proj, num_layers=3)
    model, embed_tokens = load_umt5(tmp_path, dtype=jnp.float32)
    ids, mask = tiny_tokenizer()(["a cat", "the dog runs on the grass"])
    reference = UMT5EncoderModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ref = reference(torch.from_numpy(ids).long(), torch.from_numpy(mask).long()).last_hidden_state.numpy()
    np.testing.assert_allclose(np.asarray(model(embed_tokens(ids), mask)), ref, atol=TOL)


@pytest.mark.parametrize("buckets,max_distance,seq", [(32, 128, 512), (8, 16, 512), (8, 32, 77), (32, 128, 1)])
def test_relative_position_buckets_match_transformers(buckets, max_distance, seq):
    from transformers.models.umt5.modeling_umt5 import UMT5Attention

    attention = UMT5Attention(hf_config(relative_attention_num_buckets=buckets,
                                        relative_attention_max_distance=max_distance), has_relative_attention_bias=True)
    rel = torch.arange(seq)[None, :] - torch.arange(seq)[:, None]
    ref = attention._relative_position_bucket(rel).numpy()
    table = umt5.relative_position_buckets(seq, buckets, max_distance)
    np.testing.assert_array_equal(table[rel.numpy() + seq - 1], ref)


def test_sharded_over_a_mesh_matches_unsharded(checkpoint, encoder):
    from wan_tpu.parallel.mesh import make_mesh

    mesh = make_mesh(dp=1, sp=2, tp=4)  # 8 simulated host devices (tests/conftest.py)
    sharded = UMT5TextEncoder.from_pretrained(checkpoint / "text_encoder", checkpoint / "tokenizer", dtype=jnp.float32,
                                              mesh=mesh)
    q = sharded.model.blocks.attention.q.weight.get_value()
    assert len(q.sharding.device_set) == 8 and not q.sharding.is_fully_replicated
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "tp", "sp")
    np.testing.assert_allclose(np.asarray(sharded.encode(PROMPTS[:2])), np.asarray(encoder.encode(PROMPTS[:2])), atol=TOL)


def test_compiled_once_per_batch_size(encoder):
    from wan_tpu.encoders.umt5_text import _embed

    encoder.encode(["a cat", "a dog"])
    before = _embed._cache_size()
    encoder.encode(["the man walks", ""])
    assert _embed._cache_size() == before
    encoder.encode(["a cat"])
    assert _embed._cache_size() == before + 1


def test_compiled_ahead_from_the_config_alone(checkpoint):
    """`compile_encode` before loading: encode then compiles nothing, and gives the same embeddings."""
    programs = []  # compiled, or taken from the persistent compilation cache
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: programs.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
    jax.monitoring.register_event_listener(
        lambda name, **_: programs.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
    prompts = PROMPTS + ["a dog", "a man"]  # a batch size no other test compiles
    config = umt5.UMT5Config.from_folder(checkpoint / "text_encoder")
    compile_encode(config, jnp.bfloat16, len(prompts))
    assert len(programs) == 1
    encoder = UMT5TextEncoder.from_pretrained(checkpoint / "text_encoder", checkpoint / "tokenizer", dtype=jnp.bfloat16)
    out = encoder.encode(prompts)
    assert len(programs) == 1
    encoder.compile(len(prompts) + 1)
    assert len(programs) == 2
    encoder.encode(prompts + ["a cat"])
    assert len(programs) == 2
    fresh = UMT5TextEncoder(*load_umt5(checkpoint / "text_encoder", jnp.bfloat16), encoder.tokenizer)
    np.testing.assert_array_equal(np.asarray(fresh.encode(prompts), np.float32), np.asarray(out, np.float32))


def _rewrite(src, dst, change):
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(change(load_file(os.path.join(src, "model.safetensors"))), os.path.join(dst, "model.safetensors"))


@pytest.mark.parametrize("change,message", [
    (lambda t: {k: v for k, v in t.items() if k != "encoder.block.1.layer.1.DenseReluDense.wo.weight"},
     "tensor 'encoder.block.1.layer.1.DenseReluDense.wo.weight' .* is missing"),
    (lambda t: {**t, "encoder.block.0.layer.0.SelfAttention.q.weight": np.zeros((8, 32), np.float32)},
     r"tensor 'encoder.block.0.layer.0.SelfAttention.q.weight' has shape \(8, 32\), but config.json implies \(32, 32\)"),
    (lambda t: {**t, "encoder.block.2.layer.0.layer_norm.weight": np.ones(32, np.float32)},
     "unexpected tensor 'encoder.block.2.layer.0.layer_norm.weight'"),
    (lambda t: {k: v for k, v in t.items() if k not in ("shared.weight", "encoder.embed_tokens.weight")},
     "tensor 'shared.weight' .* is missing"),
])
def test_bad_weights_are_a_one_line_user_error(checkpoint, tmp_path, change, message):
    _rewrite(checkpoint / "text_encoder", tmp_path / "te", change)
    with pytest.raises(WanInputError, match=message) as e:
        load_umt5(tmp_path / "te")
    assert "\n" not in str(e.value)


def test_tied_embedding_under_either_name(checkpoint, tmp_path, encoder):
    def rename(t):
        t = dict(t)
        t["encoder.embed_tokens.weight"] = t.pop("shared.weight", t.get("encoder.embed_tokens.weight"))
        return t

    _rewrite(checkpoint / "text_encoder", tmp_path / "te", rename)
    _, embed_tokens = load_umt5(tmp_path / "te", dtype=jnp.float32)
    np.testing.assert_array_equal(embed_tokens.table, encoder.embed_tokens.table)


def test_unsupported_activation_is_a_user_error():
    with pytest.raises(WanInputError, match="feed_forward_proj 'gated-silu-x' is not supported"):
        umt5.UMT5Config(vocab_size=8, d_model=4, d_kv=2, d_ff=8, num_layers=1, num_heads=2,
                        feed_forward_proj="gated-silu-x")
    with pytest.raises(WanInputError, match="'swish' is not supported"):
        umt5.UMT5Config(vocab_size=8, d_model=4, d_kv=2, d_ff=8, num_layers=1, num_heads=2, feed_forward_proj="swish")


def test_tokenizer_matches_auto_tokenizer(checkpoint):
    """tokenizer.json through `tokenizers` = transformers' AutoTokenizer, ids and mask, on every text."""
    ours = UMT5Tokenizer.from_folder(checkpoint / "tokenizer")
    reference = AutoTokenizer.from_pretrained(checkpoint / "tokenizer")
    for tokenizer in (ours, tiny_tokenizer()):
        ids, mask = tokenizer(TEXTS)
        ref = reference(TEXTS, padding="max_length", max_length=512, truncation=True, add_special_tokens=True,
                        return_attention_mask=True, return_tensors="np")
        np.testing.assert_array_equal(ids, ref["input_ids"])
        np.testing.assert_array_equal(mask, ref["attention_mask"])
        assert ids.dtype == mask.dtype == np.int32 and ids.shape == (len(TEXTS), 512)


def test_tiny_tokenizer_is_transformers_t5_tokenizer():
    from wan_tpu.encoders.tokenizers import _tiny_backend

    hf = tiny_hf_tokenizer()
    assert json.loads(_tiny_backend().to_str()) == json.loads(hf.backend_tokenizer.to_str())
    assert len(hf) == TINY_VOCAB_SIZE and (hf.pad_token_id, hf.eos_token_id, hf.unk_token_id) == (0, 1, 2)
    ids, _ = tiny_tokenizer()(["A cat walks on the grass, 4k video."])
    assert 2 not in ids[0]  # no <unk>


def test_missing_folder_is_a_user_error(tmp_path, checkpoint):
    with pytest.raises(WanInputError, match="text_encoder folder .* has no config.json"):
        UMT5TextEncoder.from_pretrained(tmp_path, checkpoint / "tokenizer")
    with pytest.raises(WanInputError, match="tokenizer folder .* has no tokenizer.json"):
        UMT5TextEncoder.from_pretrained(checkpoint / "text_encoder", tmp_path)
    encoder = UMT5TextEncoder.from_pretrained(checkpoint / "text_encoder", checkpoint / "tokenizer")
    for prompts in ("a cat", []):
        with pytest.raises(WanInputError, match="non-empty list of prompts"):
            encoder.encode(prompts)


def test_tiny_generate_imports_no_torch(tmp_path):
    """The tiny preset's whole T2V `generate` runs without torch, transformers or torchax in the process."""
    script = (
        "import sys\n"
        "from wan_tpu.wan.cli import main\n"
        f"code = main(['--model', 'tiny', '--prompt', 'a cat', '--size', '32*32', '--frames', '5', '--steps', '1',"
        f" '--output', {str(tmp_path / 'cat.mp4')!r}])\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'torchax', 'diffusers'})\n"
        "print('LOADED', loaded)\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "WAN_TPU_CACHE_DIR": str(tmp_path / "cache"), "XLA_FLAGS": os.environ["ONE_DEVICE_XLA_FLAGS"]}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOADED []" in done.stdout
    assert (tmp_path / "cat.mp4").is_file()
