"""An HTTP endpoint compatible with the authors' real-robot server (`scripts/evaluation/real_eval_server.py`).

    python -m wan_tpu.unifolm --model ckpt/unifolm-wma-0 --serve 8000 [--steps 16] [--fs 15]

`POST /predict_action` with their JSON payload — `observation.images.top` (n_obs, 3, H, W) pixel values
0..255, `observation.state` (n_obs, dof) in robot units, `action` (ignored, zeros in their client) and
`language_instruction` — answers `{"result": "ok", "action": [[...] × 16], "desc": "success"}` with the
16-step chunk unnormalised by the min-max table and cut to the robot's DoF; any failure answers
`{"result": "error", "desc": ...}` as theirs. As their server: decision-making with the action tokens
dropped (`keep_action_tokens=False`), 16 DDIM steps, eta 1; images of another size are resized (short
side, bilinear) and centre-cropped as their `resize_center_crop` transform (PIL's filter, not
torchvision's: close, not bit-exact). Binds 127.0.0.1 only; put a proxy in front to expose it.
"""

from __future__ import annotations

import json
import traceback
from http.server import BaseHTTPRequestHandler, HTTPServer

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


def predict_action(pipe, payload: dict, num_steps: int = 16, eta: float = 1.0, seed: int = 123, fs=None) -> dict:
    """One request of the authors' protocol → their response dict."""
    try:
        images = np.asarray(payload["observation.images.top"], np.float32)
        if images.ndim == 3:
            images = images[None]
        if images.ndim != 4 or images.shape[1] != 3:
            raise WanInputError(f"observation.images.top must be (n, 3, H, W), got shape {images.shape}")
        frames = resize_center_crop(images, pipe.height, pipe.width)
        out = pipe.decide(str(payload["language_instruction"]), frames, payload["observation.state"],
                          num_steps=num_steps, eta=eta, seed=seed, fs=fs, keep_action_tokens=False)
        return {"result": "ok", "action": np.asarray(out.actions).tolist(), "desc": "success"}
    except Exception:  # noqa: BLE001 — the protocol reports every failure in the response, as theirs
        return {"result": "error", "desc": traceback.format_exc()}


def make_server(pipe, port: int, **options) -> HTTPServer:
    """A server on 127.0.0.1:`port` (0: any free port) answering POST /predict_action."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            if self.path != "/predict_action":
                self.send_error(404, "only POST /predict_action")
                return
            try:
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                response = predict_action(pipe, payload, **options)
            except json.JSONDecodeError as e:
                response = {"result": "error", "desc": f"the body is not JSON: {e}"}
            body = json.dumps(response).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):
            pass

    # Single-threaded on purpose: one request at a time on the accelerator (the pipeline is not re-entrant).
    return HTTPServer(("127.0.0.1", port), Handler)


def serve(args) -> None:
    from wan_tpu.runtime.cli import dtype_of, parse_mesh
    from wan_tpu.unifolm.pipeline import UnifolmPipeline

    pipe = UnifolmPipeline.from_pretrained(args.model, mesh=parse_mesh(args.mesh), dtype=dtype_of(args.dtype),
                                           attention=args.attention, stats=args.stats,
                                           encoder_dtype=dtype_of(args.encoder_dtype),
                                           compile_cache=not args.no_compile_cache)
    if not pipe.has_heads:
        raise WanInputError(f"{pipe.name} has no action head; serve a UnifoLM-WMA-0 checkpoint")
    server = make_server(pipe, args.serve, num_steps=args.steps or 16, eta=args.eta, seed=args.seed, fs=args.fs)
    print(f"serving POST http://127.0.0.1:{server.server_address[1]}/predict_action ({pipe.name}); Ctrl-C stops")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
