"""`python -m wan_tpu.generate`: the Wan command line (`wan_tpu.wan.cli`), kept at the name users type."""

from wan_tpu.wan.cli import main

if __name__ == "__main__":
    from wan_tpu.runtime.cli import exit_now

    exit_now(main())
