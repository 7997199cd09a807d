"""`python -m wan_tpu.matrix_game`: play Matrix-Game-2 from an image (`wan_tpu.matrix_game.cli`)."""

from wan_tpu.matrix_game.cli import main
from wan_tpu.runtime.cli import exit_now

exit_now(main())
