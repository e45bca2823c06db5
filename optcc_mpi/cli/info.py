"""``optcc-mpi info``: versions, MPI library and launcher, GPU and CUDA-awareness."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def collect() -> dict[str, Any]:
    """Everything ``info`` reports, as a dictionary (the provenance record's parts, see
    :mod:`optcc_mpi.lab.provenance`, and what needs MPI initialised)."""
    from mpi4py import MPI

    import optcc_mpi
    from optcc_mpi import backend, simulate
    from optcc_mpi.lab import provenance

    mpi = provenance.mpi()  # after the import above: read from the loaded library
    info: dict[str, Any] = {
        "optcc_mpi": optcc_mpi.__version__,
        **provenance.versions(),
        "mpi_name": mpi["vendor"],
        "mpi_version": mpi["version"],
        "mpi_family": mpi["family"],
        "mpi_vendor": f"{mpi['vendor']} {mpi['version']}",
        "mpi_standard": mpi["standard"],
        "mpi_library": mpi["library"],
        "mpi_ranks": MPI.COMM_WORLD.Get_size(),
        "launcher": provenance.launcher(),
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
    lr = info["launcher"]
    launcher = lr.get("describe") or f"none: {lr.get('error')}"
    rows = [
        ("optcc_mpi", info["optcc_mpi"]),
        ("Python", f"{info['python']} ({info['platform']})"),
        ("NumPy", info["numpy"]),
        ("ml_dtypes", info["ml_dtypes"]),
        ("h5py / HDF5", f"{info['h5py']} / {info['hdf5']}"),
        ("mpi4py", info["mpi4py"]),
        ("MPI library", f"{info['mpi_vendor']} (MPI {info['mpi_standard']})"),
        ("MPI build", info["mpi_library"]),
        ("launcher", launcher),
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
        description="Show the versions of Python, NumPy and mpi4py, the MPI library (MPICH, "
        "Open MPI, ...) and its version, the launcher that `demo`, the testbed and sweeps "
        "will start ranks with, whether CuPy and a GPU are usable, and whether the MPI "
        "library accepts device buffers (CUDA-aware).",
        epilog="examples:\n  optcc-mpi info\n  optcc-mpi info --json > info.json\n"
        "  srun -n 1 optcc-mpi info      # what the compute nodes see",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(json=False)))
