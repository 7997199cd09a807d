"""`python -m wan_tpu.generate`: the Wan command line (`wan_tpu.wan.cli`), kept at the name users type."""

if __name__ == "__main__":
    from wan_tpu.commands import generate

    generate()
