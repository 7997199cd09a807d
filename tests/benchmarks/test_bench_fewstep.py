"""`benchmarks/bench_fewstep.py`: the random kohya-format LoRA it writes is what both loaders take — every
key of every block (ours: `check_lora`; diffusers: its Wan converter leaves no key unconverted) — and
the table prints every run, failed ones with their reason. (Whole runs are device benchmarks; the
script's docstring gives the CPU smoke commands.)"""


import bench_fewstep as bench
import numpy as np


def test_random_lora_loads_in_both_loaders(tmp_path):
    from diffusers import WanPipeline

    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.wan.lora import check_lora
    from wan_tpu.wan.transformer import abstract_transformer

    cfg = VARIANTS["tiny"].transformer
    path = bench.write_lora(str(tmp_path / "lora.safetensors"), "tiny", rank=4)
    assert check_lora(abstract_transformer(cfg), path) == cfg.num_layers * 10
    converted = WanPipeline.lora_state_dict(path)
    assert len(converted) == cfg.num_layers * 10 * 2
    a = converted["transformer.blocks.1.ffn.net.0.proj.lora_A.weight"].float().numpy()
    assert a.shape == (4, cfg.inner_dim) and 0.5 < np.std(a) * cfg.inner_dim ** 0.5 < 2


def test_table_lists_every_run():
    row = dict(load=10.0, lora=1.5, text=2.0, denoise=30.0, excl_compile=20.0, steps=4, skipped=1, decode=3.0,
               peak_bytes=2**31, device="cpu")
    text = bench.format_table([{"run": "wan_tpu fbcache (0.05)", **row}, {"run": "diffusers", "status": "failed"}])
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()]
    assert cells[0] == ["run", "load", "lora", "text", "denoise", "excl.compile", "s/step", "skipped", "decode", "total",
                        "wall", "peak GiB"]
    assert cells[2] == ["wan_tpu fbcache (0.05)", "10.0", "1.5", "2.0", "30.0", "20.0", "5.000", "1/4", "3.0", "36.5",
                        "46.5", "2.0"]
    assert cells[3] == ["diffusers", "failed", *[""] * 10]
