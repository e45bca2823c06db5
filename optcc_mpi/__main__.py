"""``python -m optcc_mpi`` runs the command-line interface."""

import sys

from optcc_mpi.cli import main

sys.exit(main())
