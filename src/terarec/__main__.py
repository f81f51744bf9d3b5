"""``python -m terarec`` (also what ``torchrun -m terarec`` runs)."""

from terarec.cli.main import run

run()
