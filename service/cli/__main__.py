"""`python -m trainmedic.service.cli`: the same as the `trainmedic` command."""
import sys

from . import main

sys.exit(main())
