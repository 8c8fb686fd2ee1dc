"""``python -m libra_jax``: the ``libra-jax`` command line (`libra_jax.cli`)."""
import sys

from libra_jax.cli import main

sys.exit(main())
