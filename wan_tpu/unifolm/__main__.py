"""`python -m wan_tpu.unifolm`: UnifoLM-WMA decision, world model, interaction, generation and serving."""

from wan_tpu.runtime.cli import exit_now
from wan_tpu.unifolm.cli import main

exit_now(main())
