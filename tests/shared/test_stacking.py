"""`wan_tpu.loading.stacking`: the shapes-only build of stacked blocks is the vmapped build's graph, and a
real build still gives every layer its own initialisation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wan_tpu.configs.matrix_game import get_variant
from wan_tpu.configs.models import VARIANTS
from wan_tpu.loading.stacking import eval_shape, stack_layers
from wan_tpu.matrix_game.model import MatrixGameTransformer
from wan_tpu.wan.transformer import WanTransformer

BUILDS = {
    "wan 1.3B": lambda: WanTransformer(VARIANTS["wan2.1-t2v-1.3b"].transformer, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
    "matrix-game universal": lambda: MatrixGameTransformer(get_variant("universal").transformer, dtype=jnp.bfloat16,
                                                           rngs=nnx.Rngs(0)),
}


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_shapes_only_build_is_the_vmapped_graph(name):
    vmapped_graph, vmapped = nnx.split(nnx.eval_shape(BUILDS[name]))
    graph, state = nnx.split(eval_shape(BUILDS[name]))
    assert graph == vmapped_graph  # programs compiled for the abstract model serve the loaded one
    shapes = lambda s: [(k, v.shape, v.dtype) for k, v in nnx.to_flat_state(s)]  # noqa: E731
    assert shapes(state) == shapes(vmapped)


def test_real_build_initialises_each_layer():
    stack = stack_layers(lambda r: nnx.Linear(4, 4, rngs=r), 3, nnx.Rngs(0))
    kernels = np.asarray(stack.kernel)
    assert kernels.shape == (3, 4, 4) and not np.allclose(kernels[0], kernels[1])
    abstract = eval_shape(lambda: stack_layers(lambda r: nnx.Linear(4, 4, rngs=r), 3, nnx.Rngs(0)))
    assert isinstance(abstract.kernel.get_value(), jax.ShapeDtypeStruct)
