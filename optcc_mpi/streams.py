"""Moved to :mod:`optcc_mpi.torch.streams` (the torch side is one subpackage); this name is
kept one release."""

from optcc_mpi.renames import moved
from optcc_mpi.torch import streams as _new

moved(__name__, _new)
