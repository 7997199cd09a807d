"""Sharding rules as data: per model family, a first-match table of `regex → PartitionSpec`.

Patterns are searched (`re.search`) in the parameter's dotted path as the loader names it; the
first that matches gives the spec, one entry per array dimension. A parameter no pattern matches
is replicated and listed as such by `wan_tpu.parallel.sharding.describe_sharding`. A spec dimension that the
mesh axes do not divide falls back to fewer axes, then to replicated, on that dimension only.

FSDP layout (Megatron split + FSDP on the other dimension):
- q/k/v and FFN-in are column-parallel: the output dimension over `tp`;
- o and FFN-out are row-parallel: the input dimension over `tp`;
- the other dimension of every large weight is FSDP-sharded over `FSDP` (`dp` and `sp`), so each
  device stores 1/(dp·sp·tp) of it; XLA gathers one layer's weights inside the layer scan.
- The leading layer axis of the DiT's stacked block parameters is never sharded (the scan slices it).
FP8 weight scales (`kernel_scale`, one per output channel) follow their kernel's output dimension.
Norm scales, biases of row-parallel layers, modulation tables, and the small patch/proj-out
weights are replicated on purpose (`REPLICATED`): they are tiny and used whole by every device.

Layouts differ by family: our DiT is Flax (`kernel` is (in, out), stacked blocks have a leading
layer axis); UMT5 and CLIP keep torch layouts (`weight` is (out, in)), CLIP torch names too.
"""

from jax.sharding import PartitionSpec as P

FSDP = ("dp", "sp")
REPLICATED = P()

DIT = (
    # Self- and cross-attention (blocks stacked on a leading layer axis).
    (r"^blocks\.attn[12]\.(to_q|to_k|to_v|add_k_proj|add_v_proj)\.kernel$", P(None, FSDP, "tp")),
    (r"^blocks\.attn[12]\.(to_q|to_k|to_v|add_k_proj|add_v_proj)\.(bias|kernel_scale)$", P(None, "tp")),
    (r"^blocks\.attn[12]\.to_out\.kernel$", P(None, "tp", FSDP)),
    (r"^blocks\.attn[12]\.to_out\.(bias|kernel_scale)$", REPLICATED),
    (r"^blocks\.attn[12]\.norm_(q|k|added_k)\.(scale|weight)$", REPLICATED),
    # Feed-forward.
    (r"^blocks\.ffn\.proj_in\.kernel$", P(None, FSDP, "tp")),
    (r"^blocks\.ffn\.proj_in\.(bias|kernel_scale)$", P(None, "tp")),
    (r"^blocks\.ffn\.proj_out\.kernel$", P(None, "tp", FSDP)),
    (r"^blocks\.ffn\.proj_out\.(bias|kernel_scale)$", REPLICATED),
    (r"^blocks\.norm\d\.(scale|weight|bias)$", REPLICATED),
    (r"^blocks\.scale_shift_table$", REPLICATED),
    # Condition embedders: time_proj alone is dim × 6·dim (157M parameters in the 14B model). Their
    # outputs stay whole: a `tp`-split modulation would split the modulated tokens by channel too,
    # and XLA would gather them back before every projection.
    (r"^condition_embedder\..*(norm\d?\.(scale|weight|bias)|pos_embed)$", REPLICATED),
    (r"^condition_embedder\..*\.kernel$", P(FSDP + ("tp",), None)),
    (r"^condition_embedder\..*\.bias$", REPLICATED),
    # Patch embedding in, unpatchify projection out: dim × (channels · patch volume), small.
    (r"^patch_embedding\.(kernel|bias)$", REPLICATED),
    (r"^proj_out\.(kernel|bias)$", REPLICATED),
    (r"^scale_shift_table$", REPLICATED),
)

# The VAE is a convolution stack with small weights: replicate them and shard activations on width.
VAE = ((r".*", REPLICATED),)

# Our UMT5 encoder (`wan_tpu.encoders.umt5`): torch layout, `weight` is (out, in); block parameters are
# stacked on a leading layer axis, which is never sharded.
UMT5 = (
    (r"^blocks\.attention\.(q|k|v)\.weight$", P(None, "tp", FSDP)),
    (r"^blocks\.attention\.o\.weight$", P(None, FSDP, "tp")),
    (r"^blocks\.attention\.relative_attention_bias\.weight$", REPLICATED),
    (r"^blocks\.ffn\.(wi|wi_0|wi_1)\.weight$", P(None, "tp", FSDP)),
    (r"^blocks\.ffn\.wo\.weight$", P(None, FSDP, "tp")),
    (r"(^|\.)(attention_norm|ffn_norm|final_layer_norm)\.weight$", REPLICATED),
)

# Our CLIP towers (`wan_tpu.encoders.clip`): transformers' names without the `vision_model.`/`text_model.`
# prefix, torch layout (`weight` is (out, in)); block parameters stacked on a leading layer axis, never sharded.
CLIP = (
    (r"^encoder\.layers\.self_attn\.(q|k|v)_proj\.weight$", P(None, "tp", FSDP)),
    (r"^encoder\.layers\.self_attn\.(q|k|v)_proj\.bias$", P(None, "tp")),
    (r"^encoder\.layers\.self_attn\.out_proj\.weight$", P(None, FSDP, "tp")),
    (r"^encoder\.layers\.self_attn\.out_proj\.bias$", REPLICATED),
    (r"^encoder\.layers\.mlp\.fc1\.weight$", P(None, "tp", FSDP)),
    (r"^encoder\.layers\.mlp\.fc1\.bias$", P(None, "tp")),
    (r"^encoder\.layers\.mlp\.fc2\.weight$", P(None, FSDP, "tp")),
    (r"^encoder\.layers\.mlp\.fc2\.bias$", REPLICATED),
    (r"(layer_norm\d|pre_layrnorm|final_layer_norm)\.(weight|bias)$", REPLICATED),
    (r"^embeddings\.(class_embedding|patch_embedding\.weight|position_embedding\.weight|token_embedding\.weight)$",
     REPLICATED),
)

# Matrix-Game-2's causal DiT: the DiT rules for its runs of stacked blocks (`blocks.{run}.…`), plus its
# action modules (≤ 3072 wide, used whole by every token: FSDP-stored, not split by heads).
MATRIX_GAME = tuple((pattern.replace(r"^blocks\.", r"^blocks\.\d+\."), spec) for pattern, spec in DIT) + (
    (r"^blocks\.\d+\.action_model\..*\.kernel$", P(None, FSDP, None)),
    (r"^blocks\.\d+\.action_model\.", REPLICATED),
)


# UniFoLM-WMA (`wan_tpu.unifolm`, Flax layout: linear kernels (in, out), conv kernels
# (*k, in, out)). FSDP on the input side, `tp` on the output side of the transformers' q/k/v and
# feed-forward-in and of every convolution; row-parallel outputs the other way round. Norms, biases
# of row-parallel layers, embeddings and the small Perceiver latents stay replicated.
_QKV = r"(to_q|to_k|to_v|to_k_ip|to_v_ip|to_k_as|to_v_as|to_k_aa|to_v_aa|to_kv|proj_in)"
UNIFOLM = (
    (rf"\.{_QKV}\.kernel$", P(FSDP, "tp")),
    (rf"\.{_QKV}\.bias$", P("tp")),
    (r"\.(to_out|proj_out)\.kernel$", P("tp", FSDP)),
    (r"\.ff\.proj_in\.kernel$", P(FSDP, "tp")),
    (r"\.ff\.proj_in\.bias$", P("tp")),
    (r"\.ff\.proj_out\.kernel$", P("tp", FSDP)),
    # The heads' 1-D convolutions (k, in, out), incl. the transposed ones (k, out, in).
    (r"(\.blocks\.\d\.conv|final_block\.conv|final_conv|residual_conv|(down|up)_modules\.\d\.3)\.kernel$",
     P(None, FSDP, "tp")),
    # 2-D convolutions (ResBlocks, temporal convs as (3, 1), resampling, ResNet18): (kh, kw, in, out).
    (r"(conv\d?|op|skip|downsample_conv|nets|input_blocks\.0\.0)\.kernel$", P(None, None, FSDP, "tp")),
    # FiLM, time-embedding and MLP-projector linears (in, out).
    (r"(cond_encoder|emb_proj|linear_\d)\.kernel$", P(FSDP, "tp")),
    (r"proj_(in|out)_action\.kernel$", REPLICATED),
    (r"\.(weight|bias|temperature)$", REPLICATED),
    (r"(latents|pos_emb)$", REPLICATED),
)

RULES = {"dit": DIT, "vae": VAE, "umt5": UMT5, "clip": CLIP, "matrix_game": MATRIX_GAME, "unifolm": UNIFOLM}
