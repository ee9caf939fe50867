"""`python -m flowlang demo`."""

import sys

from flowlang.cli import main

sys.exit(main())
