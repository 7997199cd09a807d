"""Flow-matching schedulers for Wan: UniPC (bh2, order 2), DPM-Solver++ (order 2) and Euler, as pure functions.

`FlowUniPCMultistep` reproduces diffusers' `UniPCMultistepScheduler(prediction_type=
"flow_prediction", use_flow_sigmas=True, solver_order=2, solver_type="bh2", predict_x0=True,
lower_order_final=True, final_sigmas_type="zero")`, the scheduler the Wan checkpoints ship with;
`FlowDPMSolverMultistep` the official `--sample_solver dpm++` (diffusers' `DPMSolverMultistepScheduler`
with flow sigmas); `FlowEuler` reproduces `FlowMatchEulerDiscreteScheduler(shift=s)`. All take the step index as an
array, so a whole denoising loop compiles once (`jax.lax.fori_loop` / `scan` over a static step
count):

    sched = FlowUniPCMultistep.create(num_inference_steps=50, shift=5.0)
    state = sched.init_state(latents)
    for i in range(sched.num_inference_steps):          # or the body of a fori_loop
        v = dit(latents, jnp.asarray(sched.timesteps)[i], ...)   # the model sees `timesteps`
        latents, state = sched.step(state, v, latents, i)

Everything that depends only on the schedule (sigmas, log-SNR steps h, the UniC 2x2 solve, the
warm-up and final lower-order steps) is computed once on the host in float64 and stored as a
per-step coefficient table; a step is then a fixed linear combination of tensors, the same
straight-line program for every step index. The tensor arithmetic runs in float32 whatever the
sample and model dtypes (as diffusers does for float32 latents); the result is cast back to the
sample's dtype. The UniPC history (x0 predictions, the last sample) is kept in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from wan_tpu.errors import WanInputError

# `FlowUniPCMultistep` coefficient table columns; step i maps (x_i, v_i, history) to x_{i+1} as
#   m   = x_i - sigma_i * v_i                                            (x0 prediction)
#   x_c = KEEP*x_i + C_LAST*x_{i-1}^c + C_M0*m_{i-1} + C_DT*(m - m_{i-1}) + C_D1*(m_{i-2} - m_{i-1})
#   x_{i+1} = P_X*x_c + P_M0*m + P_D1*(m_{i-1} - m)
# where x^c is the corrected sample. At step 0 KEEP = 1 and the UniC terms are 0, which replaces
# diffusers' "no corrector on the first step" branch with plain arithmetic.
KEEP, C_LAST, C_M0, C_DT, C_D1, P_X, P_M0, P_D1 = range(8)


def _check(steps: int, shift: float) -> None:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise WanInputError(f"number of inference steps must be a positive integer, got {steps!r}; pass --steps N with N >= 1")
    if not (isinstance(shift, (int, float, np.floating, np.integer)) and math.isfinite(shift) and shift > 0):
        raise WanInputError(f"flow shift must be a positive number, got {shift!r}; pass --shift S with S > 0 (Wan uses 3 to 12)")


def _shifted(sigmas: np.ndarray, shift) -> np.ndarray:
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def _log_snr(sigma: float) -> float:
    """lambda = log(alpha / sigma) of the flow path x_t = (1 - sigma) x0 + sigma noise."""
    return math.inf if sigma == 0 else math.log(1.0 - sigma) - math.log(sigma)


class UniPCState(NamedTuple):
    """What UniPC carries between steps (float32, the sample's shape)."""

    x0_prev: jax.Array  # x0 prediction of the previous step, m_{i-1}
    x0_prev2: jax.Array  # m_{i-2}
    last_sample: jax.Array  # the (corrected) sample the previous step started from, x_{i-1}^c


@dataclass(frozen=True, eq=False)
class FlowUniPCMultistep:
    """UniPC multistep (bh2, order 2, x0 form) on the rectified-flow path; see the module docstring.

    `timesteps` (N,) float32: what the model receives at each step (diffusers' integer timesteps).
    `sigmas` (N+1,) float32: the noise level at each step, ending at 0.
    `coefficients` (N, 8) float32: the per-step table described above `KEEP`.
    """

    timesteps: np.ndarray
    sigmas: np.ndarray
    coefficients: np.ndarray

    @classmethod
    def create(cls, num_inference_steps: int, shift: float, num_train_timesteps: int = 1000) -> FlowUniPCMultistep:
        _check(num_inference_steps, shift)
        n = int(num_inference_steps)
        return cls.from_sigmas(np.linspace(1.0, 1.0 / num_train_timesteps, n + 1)[:-1], shift, num_train_timesteps)

    @classmethod
    def from_sigmas(cls, sigmas, shift: float, num_train_timesteps: int = 1000) -> FlowUniPCMultistep:
        """A run over given (unshifted) noise levels, as diffusers' `set_timesteps(sigmas=...)`: shifted,
        then the model receives the integer part of 1000 × each shifted sigma."""
        sig = _shifted(np.array(sigmas, np.float64), float(shift))
        # diffusers nudges sigma_0 off 1 so that log(alpha_0) stays finite, then truncates the
        # timesteps to integers before rounding sigmas to float32; we keep all three choices.
        if abs(sig[0] - 1.0) < 1e-6:
            sig[0] -= 1e-6
        timesteps = (sig * num_train_timesteps).astype(np.int64).astype(np.float32)
        sigmas = np.append(sig, 0.0).astype(np.float32)
        return cls(timesteps, sigmas, _unipc_coefficients(sigmas))

    @property
    def num_inference_steps(self) -> int:
        return len(self.timesteps)

    def init_state(self, sample: jax.Array) -> UniPCState:
        zeros = jnp.zeros(sample.shape, jnp.float32)
        return UniPCState(zeros, zeros, zeros)

    def step(self, state: UniPCState, model_output: jax.Array, sample: jax.Array, i) -> tuple[jax.Array, UniPCState]:
        """One UniC correction of `sample` then one UniP prediction; `i` may be a traced index."""
        c = jnp.asarray(self.coefficients)[i]
        x = sample.astype(jnp.float32)
        m = x - jnp.asarray(self.sigmas)[i] * model_output.astype(jnp.float32)
        m1, m2 = state.x0_prev, state.x0_prev2
        x_c = (
            c[KEEP] * x
            + c[C_LAST] * state.last_sample
            + c[C_M0] * m1
            + c[C_DT] * (m - m1)
            + c[C_D1] * (m2 - m1)
        )
        x_next = c[P_X] * x_c + c[P_M0] * m + c[P_D1] * (m1 - m)
        return x_next.astype(sample.dtype), UniPCState(m, m1, x_c)


def _unipc_coefficients(sigmas: np.ndarray) -> np.ndarray:
    n = len(sigmas) - 1
    sig = sigmas.astype(np.float64)
    lam = [_log_snr(s) for s in sig]
    # Order 2 needs one earlier x0 prediction (warm-up) and drops to 1 on the last step
    # (lower_order_final), where sigma_next = 0 makes the order-1 step return x0 exactly.
    order = [min(2, n - i, i + 1) for i in range(n)]
    table = np.zeros((n, 8), np.float64)
    for i in range(n):
        if i == 0:
            table[i, KEEP] = 1.0
        else:
            # UniC at step i corrects the UniP step i-1 -> i, with that step's order.
            h = lam[i] - lam[i - 1]
            alpha_t = 1.0 - sig[i]
            phi1 = math.expm1(-h)  # bh2: B(h) = e^{-h} - 1 = h*phi_1 in the x0 form
            table[i, C_LAST] = sig[i] / sig[i - 1]
            table[i, C_M0] = -alpha_t * phi1
            if order[i - 1] == 1:
                table[i, C_DT] = -alpha_t * phi1 * 0.5
            else:
                r1 = (lam[i - 2] - lam[i - 1]) / h
                # UniC order 2: solve [[1, 1], [r1, 1]] rho = b with b_k from the phi_k(h) series.
                phi_k = phi1 / -h - 1.0
                b1 = phi_k / phi1
                b2 = (phi_k / -h - 0.5) * 2.0 / phi1
                rho0 = (b2 - b1) / (r1 - 1.0)
                rho1 = b1 - rho0
                table[i, C_DT] = -alpha_t * phi1 * rho1
                table[i, C_D1] = -alpha_t * phi1 * rho0 / r1
        h = lam[i + 1] - lam[i]
        alpha_t = 1.0 - sig[i + 1]
        phi1 = math.expm1(-h)
        table[i, P_X] = sig[i + 1] / sig[i]
        table[i, P_M0] = -alpha_t * phi1
        if order[i] == 2:
            # UniP order 2 uses rho = 1/2 (diffusers' closed form) on D1 = (m_{i-1} - m_i) / r.
            r = (lam[i - 1] - lam[i]) / h
            table[i, P_D1] = -alpha_t * phi1 * 0.5 / r
    return table.astype(np.float32)


@dataclass(frozen=True, eq=False)
class FlowEuler:
    """First-order flow-matching Euler: x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v_i.

    `timesteps` (N,) float32 = 1000 * sigmas[:-1]; `sigmas` (N+1,) float32 ending at 0.
    """

    timesteps: np.ndarray
    sigmas: np.ndarray

    @classmethod
    def create(cls, num_inference_steps: int, shift: float, num_train_timesteps: int = 1000) -> FlowEuler:
        _check(num_inference_steps, shift)
        # diffusers builds this schedule from its training sigmas, which are already shifted (in
        # float32), and then shifts again: the last sigma is shift(shift(1/T)). Kept so that both
        # produce the same timesteps.
        s = np.float32(1.0) / np.float32(num_train_timesteps)
        sigma_min = np.float32(shift) * s / (np.float32(1.0) + np.float32(shift - 1) * s)
        t = np.linspace(float(num_train_timesteps), float(sigma_min) * num_train_timesteps, int(num_inference_steps))
        sigmas = np.append(_shifted(t / num_train_timesteps, float(shift)).astype(np.float32), np.float32(0.0))
        return cls(sigmas[:-1] * np.float32(num_train_timesteps), sigmas)

    @classmethod
    def from_sigmas(cls, sigmas=None, shift: float = 1.0, num_train_timesteps: int = 1000, timesteps=None) -> FlowEuler:
        """A run over given sigmas and/or timesteps, as diffusers' `set_timesteps(sigmas=..., timesteps=...)`:
        the sigmas (default: timesteps / 1000) are shifted in float32; the model receives the given
        timesteps, else 1000 × the shifted sigmas (so given timesteps are used as they are, unshifted)."""
        given_t = None if timesteps is None else np.asarray(timesteps, np.float32)
        base = given_t / num_train_timesteps if sigmas is None else np.asarray(sigmas, np.float32)
        sig = _shifted(base, float(shift))  # float32: numpy keeps Python scalars weak, as diffusers' arithmetic does
        t = sig * np.float32(num_train_timesteps) if given_t is None else given_t
        return cls(t, np.append(sig, np.float32(0.0)))

    @property
    def num_inference_steps(self) -> int:
        return len(self.timesteps)

    def init_state(self, sample: jax.Array) -> tuple:
        return ()

    def step(self, state: tuple, model_output: jax.Array, sample: jax.Array, i) -> tuple[jax.Array, tuple]:
        dt = jnp.asarray(self.sigmas[1:] - self.sigmas[:-1])[i]
        x_next = sample.astype(jnp.float32) + dt * model_output.astype(jnp.float32)
        return x_next.astype(sample.dtype), state


class DPMState(NamedTuple):
    """What DPM-Solver++ carries between steps: the previous x0 prediction (float32)."""

    x0_prev: jax.Array


@dataclass(frozen=True, eq=False)
class FlowDPMSolverMultistep:
    """Multistep DPM-Solver++ (order 2, midpoint) on the rectified-flow path, as pure functions.

    Reproduces diffusers' `DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type=
    "flow_prediction", flow_shift=s, algorithm_type="dpmsolver++", solver_order=2)` (the official
    Wan `--sample_solver dpm++`): first order on the first step and on the last (`final_sigmas_type=
    "zero"` lands on x0 exactly), second order in between. Step i maps (x_i, v_i, m_{i-1}) to

        m = x_i - sigma_i * v_i;   x_{i+1} = P_X*x_i + P_M0*m + P_M1*m_{i-1}

    with the per-step coefficients (N, 3) computed once in float64 on the host.

    `timesteps` (N,) float32: what the model receives (diffusers' integer timesteps).
    `sigmas` (N+1,) float32 ending at 0.
    """

    timesteps: np.ndarray
    sigmas: np.ndarray
    coefficients: np.ndarray

    @classmethod
    def create(cls, num_inference_steps: int, shift: float, num_train_timesteps: int = 1000) -> FlowDPMSolverMultistep:
        _check(num_inference_steps, shift)
        n = int(num_inference_steps)
        # diffusers: sigmas = shift(1 - alphas) over alphas = linspace(1, 1/T, N+1), flipped, last dropped.
        sig = np.flip(_shifted(1.0 - np.linspace(1.0, 1.0 / num_train_timesteps, n + 1), float(shift)))[:-1].copy()
        timesteps = (sig * num_train_timesteps).astype(np.int64).astype(np.float32)
        sigmas = np.append(sig, 0.0).astype(np.float32)
        return cls(timesteps, sigmas, _dpm_coefficients(sigmas))

    @property
    def num_inference_steps(self) -> int:
        return len(self.timesteps)

    def init_state(self, sample: jax.Array) -> DPMState:
        return DPMState(jnp.zeros(sample.shape, jnp.float32))

    def step(self, state: DPMState, model_output: jax.Array, sample: jax.Array, i) -> tuple[jax.Array, DPMState]:
        c = jnp.asarray(self.coefficients)[i]
        x = sample.astype(jnp.float32)
        m = x - jnp.asarray(self.sigmas)[i] * model_output.astype(jnp.float32)
        x_next = c[0] * x + c[1] * m + c[2] * state.x0_prev
        return x_next.astype(sample.dtype), DPMState(m)


def _dpm_coefficients(sigmas: np.ndarray) -> np.ndarray:
    n = len(sigmas) - 1
    sig = sigmas.astype(np.float64)
    lam = [_log_snr(s) for s in sig]
    table = np.zeros((n, 3), np.float64)
    for i in range(n):
        alpha_t = 1.0 - sig[i + 1]
        phi = math.expm1(-(lam[i + 1] - lam[i]))  # e^{-h} - 1
        table[i, 0] = sig[i + 1] / sig[i]
        if i == 0 or i == n - 1:
            table[i, 1] = -alpha_t * phi
        else:
            # Midpoint: D0 = m, D1 = (m - m_{i-1}) / r0; x = A x - a*phi*D0 - 0.5*a*phi*D1.
            r0 = (lam[i] - lam[i - 1]) / (lam[i + 1] - lam[i])
            table[i, 1] = -alpha_t * phi * (1.0 + 0.5 / r0)
            table[i, 2] = alpha_t * phi * 0.5 / r0
    return table.astype(np.float32)


SCHEDULERS = {"unipc": FlowUniPCMultistep, "euler": FlowEuler, "dpm++": FlowDPMSolverMultistep}


def make_scheduler(name: str, num_inference_steps: int, shift: float):
    """The scheduler called `name` ("unipc", "euler" or "dpm++") for a run of `num_inference_steps`."""
    if name not in SCHEDULERS:
        raise WanInputError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name].create(num_inference_steps, shift)


def make_custom_scheduler(name: str, shift: float, sigmas=None, timesteps=None) -> FlowUniPCMultistep | FlowEuler:
    """Scheduler `name` over a given schedule (few-step / step-distilled sampling): `sigmas`, noise levels
    in (0, 1] before the shift, and/or (Euler only) `timesteps` in (0, 1000], what the model receives;
    each strictly decreasing. As diffusers' `set_timesteps(sigmas=..., timesteps=...)` of
    `FlowMatchEulerDiscreteScheduler` and `UniPCMultistepScheduler` (which takes sigmas only)."""
    _check(1, shift)
    if sigmas is None and timesteps is None:
        raise WanInputError("pass sigmas or timesteps (--sigmas / --timesteps) for a custom schedule")
    for values, flag, top in ((sigmas, "--sigmas", 1.0), (timesteps, "--timesteps", 1000.0)):
        if values is not None:
            _check_schedule(values, flag, top)
    if sigmas is not None and timesteps is not None and len(sigmas) != len(timesteps):
        raise WanInputError(f"--sigmas has {len(sigmas)} values and --timesteps {len(timesteps)}; give one per step")
    if name == "euler":
        return FlowEuler.from_sigmas(sigmas, shift, timesteps=timesteps)
    if name == "unipc" and timesteps is None:
        return FlowUniPCMultistep.from_sigmas(sigmas, shift)
    if name == "unipc":
        raise WanInputError("UniPC takes a schedule as --sigmas (timestep / 1000), not --timesteps (as diffusers' "
                            "UniPCMultistepScheduler); or use --scheduler euler")
    raise WanInputError(f"a custom schedule (--sigmas / --timesteps) works with --scheduler euler or unipc, not {name!r}")


def _check_schedule(values, flag: str, top: float) -> None:
    try:
        v = np.asarray(values, np.float64)
    except (TypeError, ValueError):
        raise WanInputError(f"{flag} must be numbers, got {values!r}") from None
    if v.ndim != 1 or v.size == 0 or not np.all(np.isfinite(v)) or np.any(v <= 0) or np.any(v > top):
        raise WanInputError(f"{flag} must be one or more numbers in (0, {top:g}], got {values!r}")
    if np.any(np.diff(v) >= 0):
        raise WanInputError(f"{flag} must decrease strictly (from noise to data), got {values!r}")
