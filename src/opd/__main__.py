"""``python -m opd``: what ``torchrun -m opd train CONFIG`` runs in every process."""

import sys

from opd.cli import main

sys.exit(main())
