"""`python -m wan_tpu.matrix_game`: the same command as `wan-matrix-game`."""

from wan_tpu.commands import matrix_game

matrix_game()
