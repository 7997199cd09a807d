"""Pallas attention kernels (installed as `wan_tpu.kernels`)."""
