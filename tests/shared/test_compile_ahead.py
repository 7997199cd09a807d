"""`wan_tpu.runtime.compile_ahead`'s pieces for compiling from shapes: `SideBySide` (lowered programs compiled
in threads of their own, a program lowered twice compiled once, the first failure raised, a stop honoured)
and `serves` (when a program traced for an abstract module is the one its loaded twin's calls run)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wan_tpu.runtime.compile_ahead import Cancelled, SideBySide, serves

X = jax.ShapeDtypeStruct((3, 5), jnp.float32)


def test_programs_compile_in_threads_of_their_own_once_each(backend_compiles):
    @jax.jit
    def double(x):
        return x * 2

    @jax.jit
    def shift(x):
        return x + 3

    seen = backend_compiles
    with SideBySide() as compiles:
        compiles.add(double.lower(X))
        compiles.add(shift.lower(X))
        compiles.add(double.lower(X))  # the same program: JAX's lowering cache gives the one computation
    ours = [(f, t) for f, t in seen if f in ("jit(double)", "jit(shift)")]
    main = threading.current_thread().name
    assert sorted(ours) == [("jit(double)", f"{main}-1"), ("jit(shift)", f"{main}-2")], ours
    seen.clear()
    np.testing.assert_array_equal(double(jnp.ones((3, 5))), 2)  # the call runs the program compiled there
    assert not [f for f, _ in seen if f == "jit(double)"], seen


def test_the_first_failure_is_raised_after_every_compile_ended_and_a_stop_is_honoured():
    @jax.jit
    def halve(x):
        return x / 2

    class Broken:
        def compile(self):
            raise RuntimeError("the compiler gave up")

    with pytest.raises(RuntimeError, match="gave up"):
        with SideBySide() as compiles:
            compiles.add(Broken())
            compiles.add(halve.lower(X))
    assert not [t for t in threading.enumerate() if t.name.startswith(threading.current_thread().name + "-")]
    stop = threading.Event()
    stop.set()
    with pytest.raises(Cancelled):
        with SideBySide(stop) as compiles:
            compiles.add(halve.lower(X))


class _Tiny(nnx.Module):
    def __init__(self, dtype):
        self.linear = nnx.Linear(4, 2, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))


def test_serves_wants_the_abstract_modules_graph_shapes_and_an_uncommitted_placement():
    abstract = nnx.eval_shape(lambda: _Tiny(jnp.float32))
    loaded = _Tiny(jnp.float32)
    assert serves(loaded, abstract)
    assert not serves(_Tiny(jnp.bfloat16), abstract)  # another dtype: another program
    graphdef, state = nnx.split(loaded)
    committed = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))  # its placement lowered in
    assert not serves(committed, abstract)
    loaded.extra = nnx.Param(jnp.zeros(1))  # another graph
    assert not serves(loaded, abstract)


def test_start_imports_imports_in_a_thread_once_and_leaves_failures_to_the_caller(monkeypatch):
    import sys

    from wan_tpu.runtime.compile_ahead import start_imports

    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    thread = start_imports("colorsys", "wan_tpu_no_such_module")
    assert thread.name == "wan_tpu-imports" and thread.daemon
    thread.join(30)
    assert "colorsys" in sys.modules and "wan_tpu_no_such_module" not in sys.modules
    assert start_imports("colorsys", "wan_tpu_no_such_module") is thread  # once per set of modules
