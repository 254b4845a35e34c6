"""`python -m flax_mha.selftest`: see `flax_mha.selftest`."""

import sys

from flax_mha.selftest import main

sys.exit(main())
