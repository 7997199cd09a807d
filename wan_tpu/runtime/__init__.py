"""What every command and pipeline runs on: caches, compile-ahead, memory, interrupts, validation, media, the CLI harness."""
