"""``python -m mpidp.run``: see mpidp.run.cli."""
import sys

from .cli import main

sys.exit(main())
