"""``optcc-mpi info``: versions, MPI library, GPU and CUDA-awareness."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any


def collect() -> dict[str, Any]:
    """Everything ``info`` reports, as a dictionary."""
    import h5py
    import ml_dtypes
    import mpi4py
    import numpy as np
    from mpi4py import MPI

    import optcc_mpi
    from optcc_mpi import backend, simulate

    info: dict[str, Any] = {
        "optcc_mpi": optcc_mpi.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "h5py": h5py.__version__,
        "hdf5": h5py.version.hdf5_version,
        "mpi4py": mpi4py.__version__,
        "mpi_vendor": "{} {}".format(MPI.get_vendor()[0], ".".join(map(str, MPI.get_vendor()[1]))),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        "mpi_ranks": MPI.COMM_WORLD.Get_size(),
        "cupy": backend.cupy_status(),
        "cuda_aware_mpi": backend.cuda_aware_mpi(),
        "simulator_engine": "compiled" if simulate._core() is not None else "python",
        "algorithms": list(optcc_mpi.ALGORITHMS),
    }
    return info


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    cp = info["cupy"]
    gpu = (
        f"yes: {cp.get('device')} (compute capability {cp.get('compute_capability')}), "
        f"CuPy {cp.get('version')}"
        if cp.get("available")
        else (
            "no GPU usable"
            + (f" ({cp['reason']})" if cp.get("reason") else "")
            + (
                f"; CuPy {cp['version']} installed"
                if cp.get("installed")
                else "; CuPy not installed"
            )
        )
    )
    rows = [
        ("optcc_mpi", info["optcc_mpi"]),
        ("Python", f"{info['python']} ({info['platform']})"),
        ("NumPy", info["numpy"]),
        ("ml_dtypes", info["ml_dtypes"]),
        ("h5py / HDF5", f"{info['h5py']} / {info['hdf5']}"),
        ("mpi4py", info["mpi4py"]),
        ("MPI library", info["mpi_library"]),
        ("MPI vendor", f"{info['mpi_vendor']} (MPI {info['mpi_standard']})"),
        ("ranks in this run", info["mpi_ranks"]),
        ("GPU", gpu),
        (
            "CUDA-aware MPI",
            "yes"
            if info["cuda_aware_mpi"]
            else "no (device buffers are staged through host memory)",
        ),
        ("simulator", info["simulator_engine"]),
        ("algorithms", ", ".join(info["algorithms"])),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "info",
        help="versions, MPI library, GPU and CUDA-awareness",
        description="Show the versions of Python, NumPy and mpi4py, the MPI library and its "
        "vendor, whether CuPy and a GPU are usable, and whether the MPI library accepts "
        "device buffers (CUDA-aware).",
        epilog="examples:\n  optcc-mpi info\n  optcc-mpi info --json > info.json\n"
        "  srun -n 1 optcc-mpi info      # what the compute nodes see",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(json=False)))
