"""The official Wan `generate.py` names: its flags as aliases of ours, its `--task` names checked
against the checkpoint.

    python -m wan_tpu.generate --task t2v-1.3B --size 832*480 --ckpt_dir ./Wan2.1-T2V-1.3B \\
        --frame_num 81 --sample_steps 50 --sample_shift 3 --sample_guide_scale 5 --base_seed 42 \\
        --sample_solver unipc --prompt "..." --save_file cat.mp4

is the same run as the same command with our names, on the official download as it is (or its
`-Diffusers` folder). `ALIASES` is the table the CLI adds (and the
README prints); flags of the official script that have no meaning here get a one-line answer
(`UNSUPPORTED`). `--base_seed -1` (the official default: a random seed) draws one and prints it.
"""

from __future__ import annotations

from wan_tpu.errors import WanInputError

# our flag → the official generate.py flag that means the same.
ALIASES = {
    "--model": "--ckpt_dir",
    "--frames": "--frame_num",
    "--steps": "--sample_steps",
    "--shift": "--sample_shift",
    "--guidance": "--sample_guide_scale",
    "--seed": "--base_seed",
    "--output": "--save_file",
    "--scheduler": "--sample_solver",
}

# official --task → the variants (wan_tpu/configs/models.py) that can run it.
TASKS = {
    "t2v-1.3B": ("wan2.1-t2v-1.3b",),
    "t2v-14B": ("wan2.1-t2v-14b",),
    "i2v-14B": ("wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p"),
    "ti2v-5B": ("wan2.2-ti2v-5b",),
    "t2v-A14B": ("wan2.2-t2v-a14b",),
    "i2v-A14B": ("wan2.2-i2v-a14b",),
}
_KINDS = {"t2v": "t2v", "i2v": "i2v", "ti2v": "ti2v"}

# Official flags with no counterpart here, and what to do instead.
UNSUPPORTED = {
    "--ulysses_size": "sequence parallelism is the mesh's sp axis: pass --mesh 1,N,1",
    "--ring_size": "sequence parallelism is the mesh's sp axis: pass --mesh 1,N,1",
    "--t5_fsdp": "the text encoder is sharded over the --mesh devices already; drop it",
    "--dit_fsdp": "the DiT is FSDP-sharded over the --mesh devices already; drop it",
    "--t5_cpu": "the text encoder runs on the devices and is released before denoising; drop it",
    "--offload_model": "each component is released when its stage is done; drop it",
    "--convert_model_dtype": "weights load in --dtype (bfloat16 by default); drop it",
    "--use_prompt_extend": "prompt extension is not part of wan_tpu; pass the extended prompt with --prompt",
}


def unsupported_message(args: list[str]) -> str | None:
    """A one-line answer when `args` (argparse's unrecognized ones) hold an official flag we do not take."""
    for arg in args:
        flag = arg.split("=")[0]
        if flag in UNSUPPORTED:
            return f"{flag} (official Wan generate.py) is not taken here: {UNSUPPORTED[flag]}"
    return None


def check_task(task: str | None, variant) -> None:
    """`--task` must name what the checkpoint holds: the kind (t2v/i2v/ti2v) always, the model too
    when the checkpoint is one of the table's (the `tiny` preset and custom test checkpoints have
    only a kind)."""
    if task is None:
        return
    if task not in TASKS:
        raise WanInputError(f"--task {task} is not one wan_tpu runs; choose one of {', '.join(TASKS)} (or leave it out: "
                            "the checkpoint says which model it is)")
    kind = _KINDS[task.split("-")[0]]
    known = bool(variant.repo)
    if (known and variant.name not in TASKS[task]) or kind != variant.task:
        raise WanInputError(f"--task {task} does not match the checkpoint, which holds {variant.name} ({variant.task}); "
                            "fix --task or --ckpt_dir/--model")
