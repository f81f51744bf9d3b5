"""The public Python calls: ``fit``, ``load`` -> ``Model``, and the training recipe the
command line runs (``training.run_training``)."""

from terarec.api.fit import fit
from terarec.api.model import Model, load

__all__ = ["Model", "fit", "load"]
