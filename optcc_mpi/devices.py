"""Moved to :mod:`optcc_mpi.torch.devices` (the torch side is one subpackage); this name is
kept one release."""

from optcc_mpi.renames import moved
from optcc_mpi.torch import devices as _new

moved(__name__, _new)
