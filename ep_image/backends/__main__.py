"""``python -m ep_image.backends``: the registry's command line."""

import sys

from ep_image.backends import main

sys.exit(main())
