"""`python -m wan_tpu.wan`: the same command as `wan-generate` (and `python -m wan_tpu.generate`)."""

from wan_tpu.commands import generate

generate()
