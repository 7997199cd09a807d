"""Matrix-Game-2 (Skywork): the causal, action-conditioned Wan DiT with static ring caches.

- `model`: `MatrixGameTransformer`, pure `forward` / `init_cache`;
- `action`: the ActionModule, `chunk_action_window` (raw action windows per chunk);
- `cache`: `KVCache`, `BlockCache`, `MatrixGameCache`, ring writes, the window's sizes per chunk (`Window`);
- `sampling`: the flow-matching schedule and `denoise_chunk` (one whole chunk, pure);
- `loading`: `load_matrix_game_transformer`, `shard_matrix_game`, `abstract_transformer`;
- `condition`: `ImageCondition`, the image + gray frames latents (fixed shape).
Configs: `wan_tpu.configs.matrix_game`.
"""

from wan_tpu.lazy import exports

_EXPORTS = {"MatrixGamePipeline": "wan_tpu.matrix_game.pipeline", "MatrixGameSession": "wan_tpu.matrix_game.pipeline"}

__all__ = sorted(_EXPORTS)
__getattr__ = exports(__name__, _EXPORTS)
