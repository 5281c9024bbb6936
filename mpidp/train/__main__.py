"""``python -m mpidp.train``: see mpidp.train.cli."""
import sys

from .cli import main

sys.exit(main())
