"""``python -m mpidp.doctor``: see mpidp.doctor."""
import sys

from . import main

sys.exit(main())
