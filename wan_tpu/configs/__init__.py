"""Model variants and sharding rule tables as data (installed as `wan_tpu.configs`)."""
