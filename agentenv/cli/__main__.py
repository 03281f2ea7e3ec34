"""``python -m agentenv.cli``: the same as the ``aenv`` script."""

import sys

from agentenv.cli.main import main

sys.exit(main())
