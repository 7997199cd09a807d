"""`profiling.op_times`: a trace's XLA ops by total time (bench_vae --profile prints it)."""

import jax
import jax.numpy as jnp

from wan_tpu.profiling import op_times, trace


def test_op_times_lists_the_traced_ops(tmp_path):
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((256, 256))
    f(x).block_until_ready()
    with trace(str(tmp_path)):
        for _ in range(3):
            f(x).block_until_ready()
    rows = op_times(str(tmp_path))
    ops = {op: (t, n) for op, t, n in rows}
    sine = [op for op in ops if "sine" in op]
    assert sine, f"no sine op among {list(ops)}"
    t, n = ops[sine[0]]
    assert t > 0 and n == 3  # numbered instances merged, one event per call
    assert [r[1] for r in rows] == sorted((r[1] for r in rows), reverse=True)
