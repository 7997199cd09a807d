"""The installed commands (`wan-generate`, `wan-matrix-game`, ...; `pyproject.toml`) and the `python -m`
entry modules. Each takes the signals first, so that a Ctrl-C during the imports that follow stops the
command cleanly (`wan_tpu.runtime.interrupt.install`), then imports its family's command line and
leaves through `exit_now` once the work is written."""

from __future__ import annotations

import importlib

from wan_tpu.runtime import interrupt

COMMANDS = {
    "wan-generate": "wan_tpu.wan.cli",
    "wan-stage1-encode": "wan_tpu.wan.stage1_encode",
    "wan-stage2-denoise": "wan_tpu.wan.stage2_denoise",
    "wan-stage3-decode": "wan_tpu.wan.stage3_decode",
    "wan-matrix-game": "wan_tpu.matrix_game.cli",
    "wan-convert-matrix-game": "wan_tpu.matrix_game.convert",
    "wan-unifolm": "wan_tpu.unifolm.cli",
    "wan-convert-unifolm": "wan_tpu.unifolm.convert",
    "wan-serve": "wan_tpu.serve.cli",
    "wan-autotune-packs": "wan_tpu.runtime.autotune_cli",
}


def run(command: str, argv=None) -> None:
    """Run `command` (a key of `COMMANDS`) as the process's command line and exit with its status."""
    interrupt.install()
    main = importlib.import_module(COMMANDS[command]).main
    from wan_tpu.runtime.cli import exit_now

    status = main(argv)
    signum = interrupt.pending()
    if status == 0 and signum is not None:
        # The signal came after the command's last safe point: its outputs are complete and kept.
        kept = interrupt.written()
        interrupt.say(f"interrupted; {'kept ' + ', '.join(kept) if kept else 'nothing written'}")
        status = 128 + signum
    exit_now(status)


def generate(argv=None):
    run("wan-generate", argv)


def stage1_encode(argv=None):
    run("wan-stage1-encode", argv)


def stage2_denoise(argv=None):
    run("wan-stage2-denoise", argv)


def stage3_decode(argv=None):
    run("wan-stage3-decode", argv)


def matrix_game(argv=None):
    run("wan-matrix-game", argv)


def convert_matrix_game(argv=None):
    run("wan-convert-matrix-game", argv)


def unifolm(argv=None):
    run("wan-unifolm", argv)


def convert_unifolm(argv=None):
    run("wan-convert-unifolm", argv)


def serve(argv=None):
    run("wan-serve", argv)


def autotune_packs(argv=None):
    run("wan-autotune-packs", argv)
