"""Moved to :mod:`optcc_mpi.torch.process_group` (the torch side is one subpackage); this name is
kept one release."""

from optcc_mpi.renames import moved
from optcc_mpi.torch import process_group as _new

moved(__name__, _new)
