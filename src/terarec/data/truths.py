"""The names of the synthetic generator's planted truths, apart from the generator so
that ``terarec synth --help`` lists them without loading numba and pyarrow."""

from __future__ import annotations

# ``fm`` is the low-rank FM truth of ``terarec.data.synth``; the others are built in
# ``terarec.data.synth_truths``.
TRUTHS = ("fm", "deep", "cross", "linear", "mixed")
