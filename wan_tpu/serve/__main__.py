"""`python -m wan_tpu.serve`: the same command as `wan-serve`."""

from wan_tpu.commands import serve

serve()
