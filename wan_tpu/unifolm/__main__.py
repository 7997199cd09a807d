"""`python -m wan_tpu.unifolm`: the same command as `wan-unifolm`."""

from wan_tpu.commands import unifolm

unifolm()
