"""Where loading a diffusers-format Wan checkpoint spends its time, each measurement in a fresh process.

    python benchmarks/bench_e2e.py --config 1.3b --prepare-only --workdir /tmp/be2e    # the checkpoint
    python benchmarks/profile_load.py /tmp/be2e/<checkpoint> --components text_encoder,transformer,vae

Rows (seconds and GB/s of the component's stored bytes):
  * `read`      the component's safetensors files read into host memory (page cache → a buffer): the
                ceiling of any loader on this host;
  * `put-1`/`put-4`  each stored tensor, as stored (no cast, no transpose), `jax.device_put` from its
                memory map and waited for, with 1 and 4 threads: the host → device ceiling of jax;
  * `put-batch` every tensor read into host memory (`TensorSource.read_into`), then one `jax.device_put`
                of the list;
  * `torch-put` the same tensors through `safetensors.torch.load_file(device="cuda")` (diffusers'
                path), where torch has CUDA;
  * `load`      our loader for the component (`WanPipeline.component`), alone in its process, with
                `import wan_tpu.wan.pipeline` timed apart (`import`);
  * `prepare`   all components read at once as `WanPipeline.prepare` does, the time each one is ready.
A process's start-up (python + `import jax` + the first device) is its own row.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402


def _bytes(files):
    return sum(os.path.getsize(f) for f in files)


def _files(path, component):
    from wan_tpu.loading.checkpoint import component_files

    return component_files(os.path.join(path, component), component)


def part_startup(path, component):
    t0 = time.perf_counter()
    import jax

    t1 = time.perf_counter()
    jax.devices()
    return {"import jax": t1 - t0, "first device": time.perf_counter() - t1}


def part_read(path, component):
    files = _files(path, component)
    t0 = time.perf_counter()
    buf = bytearray(256 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return {"read": time.perf_counter() - t0, "bytes": _bytes(files)}


def _put(path, component, threads):
    import jax
    import numpy as np

    from wan_tpu.loading.checkpoint import TensorSource

    jax.devices()
    files = _files(path, component)
    tensors = TensorSource(files)

    def put(name):
        return jax.device_put(np.asarray(tensors[name])).block_until_ready()

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(put, list(tensors)):
            pass
    return {f"put-{threads}": time.perf_counter() - t0, "bytes": _bytes(files)}


def part_put_batch(path, component):
    import jax
    import numpy as np

    from wan_tpu.loading.checkpoint import TensorSource

    jax.devices()
    files = _files(path, component)
    tensors = TensorSource(files)
    t0 = time.perf_counter()
    hosts = []
    for name in tensors:
        hosts.append(np.empty(tensors.shape(name), tensors.dtype(name)))
        tensors.read_into(name, hosts[-1])
    t1 = time.perf_counter()
    jax.block_until_ready(jax.device_put(hosts))
    return {"put-batch": time.perf_counter() - t0, "read_into": t1 - t0, "bytes": _bytes(files)}


def part_put1(path, component):
    return _put(path, component, 1)


def part_put4(path, component):
    return _put(path, component, 4)


def part_torch_put(path, component):
    import torch

    if not torch.cuda.is_available():
        return {}
    from safetensors.torch import load_file

    torch.zeros(1, device="cuda")
    files = _files(path, component)
    t0 = time.perf_counter()
    for f in files:
        load_file(f, device="cuda")
    torch.cuda.synchronize()
    return {"torch-put": time.perf_counter() - t0, "bytes": _bytes(files)}


def part_load(path, component):
    import jax

    jax.devices()
    t0 = time.perf_counter()
    from wan_tpu.wan.pipeline import WanPipeline

    t1 = time.perf_counter()

    pipe = WanPipeline.from_pretrained(path)
    t2 = time.perf_counter()
    loaded = pipe.component(component)
    jax.block_until_ready(jax.tree.leaves(getattr(loaded, "state", None) or []))
    return {"import": t1 - t0, "load": time.perf_counter() - t2, "bytes": _bytes(_files(path, component))}


def part_prepare(path, component):
    import jax

    jax.devices()
    from wan_tpu.wan.pipeline import WanPipeline

    pipe = WanPipeline.from_pretrained(path)
    t0 = time.perf_counter()
    out = {}
    with pipe.prepare(pipe.settings()) as warmup:
        names = {future: name for name, future in warmup.loads.items()}
        for future in concurrent.futures.as_completed(names):
            future.result()
            out[f"ready {names[future]}"] = time.perf_counter() - t0
        warmup.cancel()
    return out


PARTS = {"startup": part_startup, "read": part_read, "put-1": part_put1, "put-4": part_put4, "put-batch": part_put_batch,
         "torch-put": part_torch_put, "load": part_load}


def child(args):
    fn = part_prepare if args.child == "prepare" else PARTS[args.child]
    harness.emit_result(fn(args.path, args.component))


def run(path, part, component, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), path, "--child", part, "--component", component]
    try:
        proc = harness.run_fresh(cmd, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    found = proc.results()
    if found:
        return {**found[0], "process": proc.wall}
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", help="a diffusers-format Wan checkpoint folder")
    p.add_argument("--components", default="text_encoder,transformer,vae")
    p.add_argument("--parts", default="startup,read,put-1,put-4,put-batch,torch-put,load,prepare")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--component", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    harness.print_env()  # this process leaves the device to the parts' processes
    parts = args.parts.split(",")
    print(harness.header("component", "part", "seconds", "GB/s", "process s", "detail"), flush=True)
    for part in parts:
        comps = ["-"] if part in ("startup", "prepare") else args.components.split(",")
        for comp in comps:
            r = run(args.path, part, comp if comp != "-" else "transformer", args.timeout)
            if "error" in r:
                print(harness.row(comp, part, "—", "—", "—", r["error"]), flush=True)
                continue
            nbytes = r.pop("bytes", None)
            wall = r.pop("process")
            key = "load" if part == "load" else part
            secs = r.get(key, sum(r.values()) if part == "startup" else None)
            rate = f"{nbytes / secs / 1e9:.2f}" if nbytes and secs else "—"
            detail = ", ".join(f"{k} {v:.2f}" for k, v in r.items() if k != key)
            print(harness.row(comp, part, f"{secs:.2f}", rate, f"{wall:.1f}", detail) if secs is not None
                  else harness.row(comp, part, "—", "—", f"{wall:.1f}", detail), flush=True)


if __name__ == "__main__":
    sys.exit(main())
