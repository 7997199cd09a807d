"""Flow schedulers against diffusers' UniPCMultistepScheduler (Wan's configuration) and
FlowMatchEulerDiscreteScheduler, on random model outputs, eagerly and inside a compiled loop.

Tolerance: relative to the largest |value| of the reference sample, 1e-6 (float32). The one
exception is noted where it applies: diffusers computes its UniPC coefficients in float32 while we
compute them in float64, so over a whole 50-step trajectory the stock float32 scheduler differs
from both ours and its own float64 run by up to ~2e-6.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from wan_tpu.errors import WanInputError
from wan_tpu.wan.schedulers import FlowEuler, FlowUniPCMultistep, UniPCState, make_scheduler

STEPS = [1, 2, 3, 10, 50]
SHIFTS = [1.0, 3.0, 5.0, 12.0]
SHAPE = (1, 4, 3, 6, 6)  # (B, C, F, H, W)
RTOL = 1e-6


def _reference(kind, n, shift, sigmas_f64=False):
    if kind == "unipc":
        # diffusers' Wan scheduler_config.json: flow_prediction, flow sigmas, order 2, bh2, x0 form.
        ref = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift, solver_order=2,
            solver_type="bh2", predict_x0=True, final_sigmas_type="zero", lower_order_final=True,
            num_train_timesteps=1000,
        )
    else:
        ref = FlowMatchEulerDiscreteScheduler(shift=shift)
    ref.set_timesteps(n)
    ref.set_begin_index(0)  # as WanPipeline does
    if sigmas_f64:
        ref.sigmas = ref.sigmas.double()
    return ref


def _ours(kind, n, shift):
    return (FlowUniPCMultistep if kind == "unipc" else FlowEuler).create(n, shift)


def _rel(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return np.abs(ours - ref).max() / np.abs(ref).max()


def _inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    return x, rng.standard_normal((n, *SHAPE)).astype(np.float32)


@pytest.mark.parametrize("kind", ["unipc", "euler"])
def test_timesteps_and_sigmas_equal_diffusers(kind):
    for n in STEPS:
        for shift in SHIFTS + [3.7]:
            ref, ours = _reference(kind, n, shift), _ours(kind, n, shift)
            np.testing.assert_array_equal(ours.timesteps, ref.timesteps.numpy().astype(np.float32))
            np.testing.assert_array_equal(ours.sigmas, ref.sigmas.numpy())
            assert ours.num_inference_steps == n


# Few-step schedules as step-distilled LoRAs use them (lightx2v: 1000, 750, 500, 250 before a shift of 5).
CUSTOM = {"sigmas": [1.0, 0.75, 0.5, 0.25], "timesteps": [1000.0, 750.0, 500.0, 250.0],
          "both": ([0.9, 0.6, 0.3], [950.0, 700.0, 120.0])}


def _custom(kind, given, shift, float64=False):
    """(diffusers scheduler after `set_timesteps(sigmas=..., timesteps=...)`, ours)."""
    from wan_tpu.wan.schedulers import make_custom_scheduler

    sigmas, timesteps = {"sigmas": (CUSTOM["sigmas"], None), "timesteps": (None, CUSTOM["timesteps"]),
                         "both": CUSTOM["both"]}[given]
    ref = _reference(kind, 1, shift)
    if kind == "unipc":  # takes sigmas only, as a numpy array
        ref.set_timesteps(sigmas=np.asarray(sigmas))
    else:
        ref.set_timesteps(sigmas=sigmas, timesteps=timesteps)
    ref.set_begin_index(0)
    if float64:
        ref.sigmas = ref.sigmas.double()
    return ref, make_custom_scheduler(kind, shift, sigmas=sigmas, timesteps=timesteps)


@pytest.mark.parametrize("kind,given", [("unipc", "sigmas"), ("euler", "sigmas"), ("euler", "timesteps"),
                                        ("euler", "both")])
def test_custom_schedules_match_diffusers(kind, given):
    """Given sigmas / timesteps: the same timesteps and sigmas as diffusers exactly, and each step of a
    trajectory within 1e-6 of diffusers run in float64."""
    for shift in (1.0, 5.0, 8.0):
        ref, ours = _custom(kind, given, shift)
        np.testing.assert_array_equal(ours.timesteps, ref.timesteps.numpy().astype(np.float32))
        np.testing.assert_array_equal(ours.sigmas, ref.sigmas.numpy())
        ref64 = _custom(kind, given, shift, float64=True)[0]
        x0, vs = _inputs(ours.num_inference_steps, seed=1)
        x64, y = torch.from_numpy(x0).double(), jnp.asarray(x0)
        state = ours.init_state(y)
        for i, t in enumerate(ref64.timesteps):
            x64 = ref64.step(torch.from_numpy(vs[i]).double(), t, x64).prev_sample
            y, state = ours.step(state, jnp.asarray(vs[i]), y, i)
            assert _rel(y, x64.numpy()) <= RTOL, (shift, i)


def test_custom_schedule_model_timesteps():
    """What the model sees: given sigmas are shifted (lightx2v's 4-step list at shift 5 → 1000, 937.5,
    833.3, 625); given timesteps are used as they are."""
    from wan_tpu.wan.schedulers import make_custom_scheduler

    euler = make_custom_scheduler("euler", 5.0, sigmas=[1.0, 0.75, 0.5, 0.25])
    np.testing.assert_allclose(euler.timesteps, [1000.0, 937.5, 833.3333, 625.0], rtol=1e-6)
    np.testing.assert_allclose(euler.sigmas, [1.0, 0.9375, 0.8333333, 0.625, 0.0], rtol=1e-6)
    unipc = make_custom_scheduler("unipc", 5.0, sigmas=[1.0, 0.75, 0.5, 0.25])
    np.testing.assert_array_equal(unipc.timesteps, [999.0, 937.0, 833.0, 625.0])  # sigma_0 nudged off 1, truncated
    given = make_custom_scheduler("euler", 5.0, timesteps=[1000, 750, 500, 250])
    np.testing.assert_array_equal(given.timesteps, [1000.0, 750.0, 500.0, 250.0])


@pytest.mark.parametrize("kind,kwargs,match", [
    ("unipc", {"timesteps": [900, 500]}, "UniPC takes a schedule as --sigmas"),
    ("euler", {"sigmas": [0.5, 0.7]}, "--sigmas must decrease strictly"),
    ("euler", {"sigmas": [1.5, 0.7]}, "--sigmas must be one or more numbers in \\(0, 1\\]"),
    ("euler", {"timesteps": [1000, 0]}, "--timesteps must be one or more numbers in \\(0, 1000\\]"),
    ("euler", {"timesteps": []}, "--timesteps must be one or more"),
    ("euler", {"sigmas": [0.9, 0.5], "timesteps": [900]}, "one per step"),
    ("euler", {}, "pass sigmas or timesteps"),
    ("ddim", {"sigmas": [0.5]}, "works with --scheduler euler or unipc"),
])
def test_bad_custom_schedules_raise_input_errors(kind, kwargs, match):
    from wan_tpu.wan.schedulers import make_custom_scheduler

    with pytest.raises(WanInputError, match=match):
        make_custom_scheduler(kind, 5.0, **kwargs)


def test_unipc_each_step_matches_diffusers():
    """Each step from diffusers' own state (history, last sample) gives diffusers' next sample."""
    for n in STEPS:
        for shift in SHIFTS:
            ref, ours = _reference("unipc", n, shift), _ours("unipc", n, shift)
            x, vs = _inputs(n)
            x = torch.from_numpy(x)
            for i, t in enumerate(ref.timesteps):
                hist = [np.zeros(SHAPE, np.float32) if m is None else m.numpy() for m in ref.model_outputs]
                last = np.zeros(SHAPE, np.float32) if ref.last_sample is None else ref.last_sample.numpy()
                state = UniPCState(jnp.asarray(hist[-1]), jnp.asarray(hist[-2]), jnp.asarray(last))
                got, _ = ours.step(state, jnp.asarray(vs[i]), jnp.asarray(x.numpy()), i)
                x = ref.step(torch.from_numpy(vs[i]), t, x).prev_sample
                assert _rel(got, x.numpy()) <= RTOL, (n, shift, i)


@pytest.mark.parametrize("kind", ["unipc", "euler"])
def test_trajectory_matches_diffusers(kind):
    for n in STEPS:
        for shift in SHIFTS:
            ref, ref64, ours = _reference(kind, n, shift), _reference(kind, n, shift, True), _ours(kind, n, shift)
            x0, vs = _inputs(n, seed=n)
            x, x64, y = torch.from_numpy(x0), torch.from_numpy(x0).double(), jnp.asarray(x0)
            state = ours.init_state(y)
            for i, t in enumerate(ref.timesteps):
                x = ref.step(torch.from_numpy(vs[i]), t, x).prev_sample
                x64 = ref64.step(torch.from_numpy(vs[i]).double(), t, x64).prev_sample
                y, state = ours.step(state, jnp.asarray(vs[i]), y, i)
                assert y.dtype == jnp.float32
                assert _rel(y, x64.numpy()) <= RTOL, (n, shift, i)
                # float32 coefficients in diffusers (see the module docstring)
                assert _rel(y, x.numpy()) <= 3e-6, (n, shift, i)


@pytest.mark.parametrize("kind", ["unipc", "euler"])
def test_compiled_loop_traced_once(kind):
    """A jitted fori_loop over a static step count reproduces the eager steps and diffusers."""
    traces = []

    def run(sched, x, vs):
        traces.append(1)

        def body(i, carry):
            x, state = carry
            return sched.step(state, vs[i], x, i)

        return jax.lax.fori_loop(0, sched.num_inference_steps, body, (x, sched.init_state(x)))[0]

    n, shift = 50, 5.0
    ours = _ours(kind, n, shift)
    compiled = jax.jit(run, static_argnums=0)
    for seed in (0, 1):
        ref = _reference(kind, n, shift, sigmas_f64=True)
        x0, vs = _inputs(n, seed)
        got = compiled(ours, jnp.asarray(x0), jnp.asarray(vs))
        y, state = jnp.asarray(x0), ours.init_state(jnp.asarray(x0))
        x = torch.from_numpy(x0).double()
        for i, t in enumerate(ref.timesteps):
            y, state = ours.step(state, jnp.asarray(vs[i]), y, i)
            x = ref.step(torch.from_numpy(vs[i]).double(), t, x).prev_sample
        assert _rel(got, y) <= RTOL
        assert _rel(got, x.numpy()) <= RTOL
    assert len(traces) == 1


@pytest.mark.parametrize("kind", ["unipc", "euler"])
def test_bf16_sample_keeps_dtype_and_float32_math(kind):
    """A bf16 sample comes back bf16; the update itself is the float32 one, rounded once."""
    ours = _ours(kind, 10, 3.0)
    x0, vs = _inputs(10)
    x = jnp.asarray(x0, jnp.bfloat16)
    s16 = s32 = ours.init_state(x)
    y16 = x
    for i in range(3):
        v = jnp.asarray(vs[i], jnp.bfloat16)
        y32, s32 = ours.step(s32, v, y16.astype(jnp.float32), i)
        y16, s16 = ours.step(s16, v, y16, i)
        assert y16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(y16), np.asarray(y32.astype(jnp.bfloat16)))


def test_bad_arguments_raise_input_errors():
    with pytest.raises(WanInputError, match="--steps"):
        FlowUniPCMultistep.create(0, 3.0)
    with pytest.raises(WanInputError, match="--shift"):
        FlowEuler.create(10, -1.0)
    with pytest.raises(WanInputError, match="unipc, euler"):
        make_scheduler("ddim", 10, 3.0)
    assert isinstance(make_scheduler("euler", 4, 3.0), FlowEuler)


def _dpm_reference(n, shift, float64=False):
    from diffusers import DPMSolverMultistepScheduler

    ref = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=shift,
                                      algorithm_type="dpmsolver++", solver_order=2, num_train_timesteps=1000)
    ref.set_timesteps(n)
    if float64:
        ref.sigmas = ref.sigmas.double()
    return ref


def test_dpm_solver_matches_diffusers():
    """FlowDPMSolverMultistep against diffusers' DPMSolverMultistepScheduler (flow sigmas, dpmsolver++,
    order 2): timesteps and sigmas exactly; every step of a trajectory within 1e-6 of diffusers run in
    float64 and 1e-5 of stock diffusers (float32 coefficients there, float64 here)."""
    from wan_tpu.wan.schedulers import FlowDPMSolverMultistep

    for n in STEPS:
        for shift in SHIFTS:
            ref, ref64 = _dpm_reference(n, shift), _dpm_reference(n, shift, float64=True)
            ours = FlowDPMSolverMultistep.create(n, shift)
            np.testing.assert_array_equal(ours.timesteps, ref.timesteps.numpy().astype(np.float32))
            np.testing.assert_array_equal(ours.sigmas, ref.sigmas.numpy())
            x0, vs = _inputs(n, seed=n)
            x, x64, y = torch.from_numpy(x0), torch.from_numpy(x0).double(), jnp.asarray(x0)
            state = ours.init_state(y)
            for i, t in enumerate(ref.timesteps):
                x = ref.step(torch.from_numpy(vs[i]), t, x).prev_sample
                x64 = ref64.step(torch.from_numpy(vs[i]).double(), t, x64).prev_sample
                y, state = ours.step(state, jnp.asarray(vs[i]), y, i)
                assert _rel(y, x64.numpy()) <= RTOL, (n, shift, i)
                assert _rel(y, x.numpy()) <= 1e-5, (n, shift, i)
    assert isinstance(make_scheduler("dpm++", 4, 3.0), FlowDPMSolverMultistep)
