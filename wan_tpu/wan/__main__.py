"""`python -m wan_tpu.wan`: the same command as `python -m wan_tpu.generate`."""

from wan_tpu.runtime.cli import exit_now
from wan_tpu.wan.cli import main

exit_now(main())
