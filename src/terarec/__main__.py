"""``python -m terarec`` (also what ``torchrun -m terarec`` runs)."""

import sys

from terarec.cli.main import main

sys.exit(main())
