"""The authors' real-robot protocol (`scripts/evaluation/real_eval_server.py`), served by `wan_tpu.serve`.

    python -m wan_tpu.unifolm --model ckpt/unifolm-wma-0 --serve 8000 [--steps 16] [--fs 15]
    python -m wan_tpu.serve --model ckpt/unifolm-wma-0 --port 8000 [--steps 16] [--fs 15]     # the same server

`POST /predict_action` with their JSON payload — `observation.images.top` (n_obs, 3, H, W) pixel values
0..255, `observation.state` (n_obs, dof) in robot units, `action` (ignored, zeros in their client) and
`language_instruction` — answers `{"result": "ok", "action": [[...] × 16], "desc": "success"}` with the
16-step chunk unnormalised by the min-max table and cut to the robot's DoF; a failure answers
`{"result": "error", "desc": <one line>}` as theirs, with HTTP 400 for a bad request (not JSON, a key
missing, a wrong shape, NaN, a body over 64 MiB: 413) and 500 for a failure of ours; the server keeps
serving either way. As their server: decision-making with the action tokens
dropped (`keep_action_tokens=False`), 16 DDIM steps, eta 1; images of another size are resized (short
side, bilinear) and centre-cropped as their `resize_center_crop` transform (PIL's filter, not
torchvision's: close, not bit-exact). Binds 127.0.0.1 unless `wan-serve --host` says otherwise (then with an
API key). This module holds the protocol (payload checks, `predict_action`); the HTTP server is `wan_tpu.serve`'s.
"""

from __future__ import annotations

import numpy as np

from wan_tpu.errors import WanInputError


def resize_center_crop(images: np.ndarray, height: int, width: int) -> np.ndarray:
    """(n, 3, H, W) 0..255 → (n, H', W', 3) uint8 at the model's size: short side resized, centre crop."""
    from PIL import Image

    out = []
    for frame in np.asarray(images, np.float32):
        img = np.clip(frame.transpose(1, 2, 0), 0, 255).astype(np.uint8)
        h, w = img.shape[:2]
        if (h, w) != (height, width):
            scale = min(height, width) / min(h, w)
            size = (max(round(w * scale), width), max(round(h * scale), height))
            img = np.asarray(Image.fromarray(img).resize(size, Image.BILINEAR))
            top, left = (img.shape[0] - height) // 2, (img.shape[1] - width) // 2
            img = img[top : top + height, left : left + width]
        out.append(img)
    return np.stack(out)


MAX_BODY = 64 * 2**20  # 64 MiB: two 3×1080×1920 frames as JSON numbers fit; a larger body is refused unread (413)


def one_line(error: BaseException) -> str:
    """An error as one line for the response's `desc` (never a traceback)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text[:300]


def _payload_images(payload: dict) -> np.ndarray:
    images = np.asarray(payload["observation.images.top"], np.float64)
    if images.ndim == 3:
        images = images[None]
    if images.ndim != 4 or images.shape[1] != 3 or images.size == 0:
        raise WanInputError(f"observation.images.top must be (n, 3, H, W), got shape {images.shape}")
    if not np.isfinite(images).all():
        raise WanInputError("observation.images.top holds NaN or infinite values")
    return images


def _payload_state(payload: dict) -> np.ndarray:
    state = np.asarray(payload["observation.state"], np.float64)
    if state.ndim == 1:
        state = state[None]
    if state.ndim != 2 or state.size == 0:
        raise WanInputError(f"observation.state must be (n, dof), got shape {state.shape}")
    if not np.isfinite(state).all():
        raise WanInputError("observation.state holds NaN or infinite values")
    return state.astype(np.float32)


def predict_action(pipe, payload: dict, num_steps: int = 16, eta: float = 1.0, seed: int = 123, fs=None) -> tuple[int, dict]:
    """One request of the authors' protocol → (HTTP status, their response dict): 200 and the actions; 400
    and a one-line `desc` for a bad request; 500 and a one-line `desc` for a failure of ours."""
    try:
        if not isinstance(payload, dict):
            raise WanInputError("the body must be a JSON object")
        missing = [k for k in ("observation.images.top", "observation.state", "language_instruction") if k not in payload]
        if missing:
            raise WanInputError(f"the request has no {', '.join(missing)}")
        images, state = _payload_images(payload), _payload_state(payload)
        frames = resize_center_crop(images, pipe.height, pipe.width)
        out = pipe.decide(str(payload["language_instruction"]), frames, state,
                          num_steps=num_steps, eta=eta, seed=seed, fs=fs, keep_action_tokens=False)
        actions = np.asarray(out.actions, np.float64)
        if not np.isfinite(actions).all():
            return 500, {"result": "error", "desc": "the predicted actions are NaN or infinite (numerical failure)"}
        return 200, {"result": "ok", "action": actions.tolist(), "desc": "success"}
    except (WanInputError, ValueError, TypeError) as e:
        return 400, {"result": "error", "desc": one_line(e)}
    except Exception as e:  # noqa: BLE001 - the protocol reports every failure in the response; the server keeps serving
        return 500, {"result": "error", "desc": f"internal error: {one_line(e)}"}


def serve_argv(args) -> list[str]:
    """`wan-unifolm --serve PORT ...` as the `wan-serve` command line that serves the same model, flags and port."""
    argv = ["--family", "unifolm", "--model", args.model, "--port", str(args.serve), "--eta", str(args.eta),
            "--encoder-dtype", args.encoder_dtype, "--seed", str(args.seed), "--dtype", args.dtype]
    for flag, value in (("--mesh", args.mesh), ("--attention", args.attention), ("--steps", args.steps),
                        ("--fs", args.fs), ("--stats", args.stats), ("--sampling-programs", args.sampling_programs)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--no-compile-cache"] if args.no_compile_cache else []) + (["--quiet"] if args.quiet else [])
