"""Wan DiT parameter names: ours → diffusers' (`diffusers_name`), and original Wan (Wan-Video/Wan2.1
`WanModel`) ↔ diffusers (`original_wan_to_diffusers`, `diffusers_to_original_wan`).

Shared by the loaders of every model built on Wan's DiT: `wan_tpu.wan.transformer_loading` /
`wan_tpu.wan.weights` (diffusers-format Wan checkpoints), `wan_tpu.wan.lora` (LoRA keys in either
naming) and `wan_tpu.matrix_game.loading` (Matrix-Game-2's original-format files).
"""

from __future__ import annotations


def diffusers_name(our_path: tuple[str, ...]) -> str:
    """Our parameter path (without the leaf) → diffusers module path."""
    out = []
    for i, seg in enumerate(our_path):
        parent = our_path[i - 1] if i else ""
        if seg == "to_out":
            out.append("to_out.0")
        elif parent in ("ffn", "ff") and seg == "proj_in":
            out.append("net.0.proj")
        elif parent in ("ffn", "ff") and seg == "proj_out":
            out.append("net.2")
        else:
            out.append(seg)
    return ".".join(out)


# Original Wan (Wan-Video/Wan2.1 `WanModel`) module names ↔ diffusers', as (original, diffusers)
# dotted prefixes matched segment by segment: top-level modules, then the modules of one block.
_ORIGINAL_TOP = (
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
    ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
    ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
    ("head.head", "proj_out"),
    ("head.modulation", "scale_shift_table"),
)
_ORIGINAL_BLOCK = tuple(
    (f"{orig_attn}.{orig}", f"{attn}.{new}")
    for orig_attn, attn in (("self_attn", "attn1"), ("cross_attn", "attn2"))
    for orig, new in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"), ("norm_q", "norm_q"),
                      ("norm_k", "norm_k"), ("k_img", "add_k_proj"), ("v_img", "add_v_proj"),
                      ("norm_k_img", "norm_added_k"))
) + (
    # The original block applies norm1 (self-attention), norm3 (cross-attention), norm2 (FFN);
    # diffusers numbers them in that order.
    ("norm3", "norm2"), ("norm2", "norm3"), ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2"),
    ("modulation", "scale_shift_table"),
)


def _rename(name: str, pairs, reverse: bool) -> str | None:
    parts = name.split(".")
    for original, diffusers in pairs:
        src, dst = (diffusers, original) if reverse else (original, diffusers)
        src = src.split(".")
        if parts[: len(src)] == src:
            return ".".join([dst, *parts[len(src):]])
    return None


def _convert_wan_name(name: str, reverse: bool) -> str:
    top = _rename(name, _ORIGINAL_TOP, reverse)
    if top is not None:
        return top
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blocks":
        rest = _rename(".".join(parts[2:]), _ORIGINAL_BLOCK, reverse)
        if rest is not None:
            return ".".join([*parts[:2], rest])
    return name


def original_wan_to_diffusers(name: str) -> str:
    """An original-format Wan parameter name (`blocks.0.self_attn.q.weight`, `head.head.bias`, …) → its
    diffusers name (`blocks.0.attn1.to_q.weight`, `proj_out.bias`); names it does not know (a
    model's own additions, e.g. Matrix-Game's `blocks.0.action_model.…`) come back unchanged."""
    return _convert_wan_name(name, reverse=False)


def diffusers_to_original_wan(name: str) -> str:
    """The inverse of `original_wan_to_diffusers` (for messages that name what a file should hold)."""
    return _convert_wan_name(name, reverse=True)
