"""``python -m mpidp.report``: see mpidp.report."""
import sys

from . import main

sys.exit(main())
