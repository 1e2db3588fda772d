"""`python -m lazytrain_accel.cli ...` = `lazytrain ...`."""

import sys

from lazytrain_accel.cli import main

sys.exit(main())
