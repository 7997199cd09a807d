"""`profiling.op_times`: a trace's XLA ops by total time (bench_vae --profile prints it)."""

import jax
import jax.numpy as jnp

from wan_tpu.runtime.profiling import op_times, trace


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


def test_op_classes_of_a_gpu_forward():
    """The names a traced GPU DiT forward shows (H200, jax 0.11.2) land in the right class: our Mosaic GPU
    attention kernels are `mpmd_map`, XLA's int8 cuBLASLt products bare custom calls that launch a GEMM."""
    from wan_tpu.runtime.profiling import op_class, op_kind

    gemm = op_kind("custom-call.17", {"nvjet_sm90_tst_192x64_64x6_1x2_h_bz_NNT", "Memset 3"})
    assert gemm == "custom-call (gemm)" and op_class(gemm) == "matmul"
    assert op_class(op_kind("custom-call.3", {"cudnn_generated_fort_native_sdpa"})) == "attention"
    assert op_class(op_kind("mpmd_map.0", {"entry_mosaic_gpu_kernel"})) == "attention"
    assert op_class(op_kind("cublas-lt-matmul.12", {"Memset 3"})) == "matmul"
    assert op_kind("loop_dynamic_slice_fusion.23") == "loop_dynamic_slice_fusion"
    assert op_class("loop_dynamic_slice_fusion").startswith("weight slices")
    assert op_class("triton_softmax").startswith("fusions") and op_class("loop_convert_fusion").startswith("fusions")


def test_gpu_monitor_log_and_summary(tmp_path):
    """`GpuMonitor`'s nvidia-smi log read back (a header, an unavailable field and a line cut by the
    sampler's exit skipped), a window of it summarised by medians; off NVIDIA GPUs it samples nothing."""
    import datetime

    from wan_tpu.runtime.profiling import GpuMonitor, clock_summary, read_smi_samples

    log = tmp_path / "smi.csv"
    log.write_text("timestamp, clocks.sm [MHz], power.draw [W], temperature.gpu, clocks_event_reasons.active\n"
                   "2026/11/26 16:16:00.000, 1980, 120.50, 40, 0x0000000000000000\n"
                   "2026/11/26 16:16:00.050, 1500, 697.10, 58, 0x0000000000000004\n"
                   "2026/11/26 16:16:00.100, [N/A], 690.00, 58, 0x0000000000000004\n"
                   "2026/11/26 16:16:00.150, 1490, 698.90, 59, 0x0000000000000004\n"
                   "2026/11/26 16:16:00.200, 14")
    rows = read_smi_samples(str(log))
    t0 = datetime.datetime(2026, 11, 26, 16, 16, 0).timestamp()
    assert [r[1] for r in rows] == [1980.0, 1500.0, 1490.0] and abs(rows[1][0] - (t0 + 0.05)) < 1e-6
    monitor = GpuMonitor()
    monitor.log = str(log)
    window = monitor.window(t0 + 0.01, t0 + 0.2)
    assert clock_summary(window, min_seconds=0.1) == "SM 1495 MHz, 698 W"
    assert clock_summary(window) == "" and clock_summary([]) == ""  # under a second: the power reading lags
    if jax.default_backend() != "gpu":
        with GpuMonitor() as idle:
            pass
        assert idle.samples() == []
