"""`python -m sharpdraft.cli ...`: the `sharpdraft` command."""
import sys

from .commands import main

sys.exit(main())
