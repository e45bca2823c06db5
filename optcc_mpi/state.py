"""Moved to :mod:`optcc_mpi.check.state` (the argument check is one subpackage); this name
is kept one release."""

from optcc_mpi.check import state as _new
from optcc_mpi.renames import moved

moved(__name__, _new)
