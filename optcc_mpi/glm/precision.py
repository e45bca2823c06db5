"""Precision recipes: one named precision per kernel slot of a CA-SGD outer iteration.

A :class:`Recipe` names a precision for each of nine slots. The slot list is our
reconstruction of the paper's nine-slot error analysis (the paper's exact list was not
available; ``docs/casgd.md`` says which parts are ours):

==============  ==========================================================================
slot            what it controls
==============  ==========================================================================
``data``        storage of X (and of the gathered rows Y)
``weights_in``  the weights as fed to the margin GEMV ``r = Y w``
``margin_acc``  accumulation of the margin GEMV
``margin``      storage of the partial margins ``r`` before they are packed
``gram_in``     inputs of the Gram product ``G = Y Y^T``
``gram_acc``    accumulation of the Gram product
``comm``        the AllReduce payload ``[r; G]`` (SGD: the margins), and its reduction
``recurrence``  the inner recurrence: correction sums, margins ``z_j``, residuals ``delta``
``update``      the gradient GEMV ``Y^T delta``, the weight update, the master weights
==============  ==========================================================================

Precisions are ``fp64``, ``fp32``, ``fp16`` and ``bf16``. Arithmetic with a 16-bit slot
is emulated: operands are rounded to the 16-bit format, the kernel runs in float32 BLAS,
and the result is rounded back (round to nearest even, through ``ml_dtypes``). For the
accumulation slots this is *more* accurate than a true 16-bit accumulator. NumPy's own
bf16 loops are never used (they are hundreds of times slower than float32 BLAS).

Presets: ``fp64``; ``fp32`` (the reference); ``C`` (X and margins in bf16, the Gram from
bf16 inputs with fp32 accumulation, communicated in fp32, recurrence and update in fp32);
``D`` (``C`` with the packed buffer communicated, and reduced, in bf16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import ArgumentError

__all__ = [
    "PRECISIONS",
    "RECIPES",
    "SLOTS",
    "Recipe",
    "compute_dtype",
    "get_recipe",
    "as_compute",
    "is_half",
    "is_tensor",
    "parse_slots",
    "rounded",
    "storage_dtype",
    "torch_dtype",
]

#: Precision names, finest first.
PRECISIONS = ("fp64", "fp32", "fp16", "bf16")

_STORAGE = {
    "fp64": np.dtype(np.float64),
    "fp32": np.dtype(np.float32),
    "fp16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
}

_HALF = frozenset(("fp16", "bf16"))

SLOTS = (
    "data",
    "weights_in",
    "margin_acc",
    "margin",
    "gram_in",
    "gram_acc",
    "comm",
    "recurrence",
    "update",
)

# Precisions are written many ways on command lines; accept the common spellings.
_ALIASES = {
    "float64": "fp64",
    "double": "fp64",
    "f64": "fp64",
    "float32": "fp32",
    "single": "fp32",
    "f32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "bfloat16": "bf16",
}


def _precision(value: str, slot: str) -> str:
    name = _ALIASES.get(str(value).lower(), str(value).lower())
    if name not in _STORAGE:
        raise ArgumentError(
            f"unknown precision {value!r} for slot {slot!r}; choose one of {', '.join(PRECISIONS)}"
        )
    return name


def storage_dtype(precision: str) -> np.dtype:
    """NumPy dtype that stores values of ``precision`` (bf16: ``ml_dtypes.bfloat16``)."""
    return _STORAGE[precision]


def compute_dtype(precision: str) -> np.dtype:
    """Dtype in which arithmetic of ``precision`` runs: float64 for fp64, else float32."""
    return _STORAGE["fp64"] if precision == "fp64" else _STORAGE["fp32"]


def is_half(precision: str) -> bool:
    """True for the 16-bit formats, whose arithmetic is emulated in float32."""
    return precision in ("fp16", "bf16")


def torch_dtype(precision: str, *, storage: bool = False) -> Any:
    """The ``torch.dtype`` of ``precision``: its arithmetic dtype (float64 for fp64, else
    float32), or with ``storage=True`` the dtype that stores it (``torch.bfloat16`` ...)."""
    import torch  # only asked for when tensors are in use

    if storage:
        return {
            "fp64": torch.float64,
            "fp32": torch.float32,
            "fp16": torch.float16,
            "bf16": torch.bfloat16,
        }[precision]
    return torch.float64 if precision == "fp64" else torch.float32


def is_tensor(a: Any) -> bool:
    """Whether ``a`` is a PyTorch tensor (checked without importing torch)."""
    return type(a).__module__.partition(".")[0] == "torch"


def as_compute(a: Any, precision: str) -> Any:
    """``a`` (NumPy or CuPy array, or tensor) in ``precision``'s arithmetic dtype, without
    rounding 16-bit values (a free no-op when already there)."""
    if type(a) is not np.ndarray and is_tensor(a):
        return a.to(torch_dtype(precision))
    return a.astype(compute_dtype(precision), copy=False)


def rounded(a: Any, precision: str) -> Any:
    """Return ``a`` held in :func:`compute_dtype` with values rounded to ``precision``.

    fp64/fp32 are a (free when already there) cast; fp16/bf16 round to nearest even
    through the 16-bit dtype and widen back to float32, so that every later kernel runs
    in float32 BLAS on exactly representable 16-bit values. Works on NumPy and CuPy
    arrays, PyTorch tensors (on their device; torch rounds to nearest even too) and
    SciPy sparse matrices (their stored values are rounded).
    """
    if type(a) is np.ndarray:  # the commonest case first: one type check
        if precision in _HALF:
            return a.astype(_STORAGE[precision]).astype(np.float32)
        return a.astype(_STORAGE["fp64" if precision == "fp64" else "fp32"], copy=False)
    if is_tensor(a):
        if is_half(precision):
            return a.to(torch_dtype(precision, storage=True)).to(torch_dtype("fp32"))
        return a.to(torch_dtype(precision))
    if hasattr(a, "tocsr") and hasattr(a, "data"):  # scipy.sparse: round the values
        out = a.astype(compute_dtype(precision), copy=True)
        if is_half(precision):
            out.data = out.data.astype(storage_dtype(precision)).astype(np.float32)
        return out
    if is_half(precision):
        return a.astype(storage_dtype(precision)).astype(np.float32)
    return a.astype(compute_dtype(precision), copy=False)


@dataclass(frozen=True)
class Recipe:
    """Precision of every slot of the CA-SGD outer iteration (see the module docstring).

    Parameters
    ----------
    name : str
        Label for reports; presets use their own name, overrides append ``+slot=prec``.
    data, weights_in, margin_acc, margin, gram_in, gram_acc, comm, recurrence, update : str
        Precision of each slot: ``fp64``, ``fp32``, ``fp16`` or ``bf16``.
    """

    name: str = "fp32"
    data: str = "fp32"
    weights_in: str = "fp32"
    margin_acc: str = "fp32"
    margin: str = "fp32"
    gram_in: str = "fp32"
    gram_acc: str = "fp32"
    comm: str = "fp32"
    recurrence: str = "fp32"
    update: str = "fp32"

    def __post_init__(self) -> None:
        for slot in SLOTS:
            object.__setattr__(self, slot, _precision(getattr(self, slot), slot))

    def with_slots(self, overrides: Mapping[str, str]) -> Recipe:
        """Return a copy with some slots changed; the name records the changes."""
        changes = {}
        for slot, value in overrides.items():
            if slot not in SLOTS:
                raise ArgumentError(
                    f"unknown precision slot {slot!r}; slots are {', '.join(SLOTS)}"
                )
            changes[slot] = _precision(value, slot)
        if not changes:
            return self
        label = self.name + "".join(f"+{k}={v}" for k, v in changes.items())
        return dataclasses.replace(self, name=label, **changes)

    def slots(self) -> dict[str, str]:
        """The nine slot precisions as a dict (without the name)."""
        return {slot: getattr(self, slot) for slot in SLOTS}

    def as_dict(self) -> dict[str, str]:
        """All fields, name included (JSON-ready)."""
        return {"name": self.name, **self.slots()}


def _uniform(name: str, precision: str) -> Recipe:
    return Recipe(name, **{slot: precision for slot in SLOTS})


_C = Recipe(
    "C",
    data="bf16",
    weights_in="fp32",
    margin_acc="fp32",
    margin="bf16",
    gram_in="bf16",
    gram_acc="fp32",
    comm="fp32",
    recurrence="fp32",
    update="fp32",
)

#: Preset recipes by name.
RECIPES: dict[str, Recipe] = {
    "fp64": _uniform("fp64", "fp64"),
    "fp32": _uniform("fp32", "fp32"),
    "C": _C,
    "D": dataclasses.replace(_C, name="D", comm="bf16"),
}


def parse_slots(items: Iterable[str] | Mapping[str, str] | None) -> dict[str, str]:
    """Parse slot overrides given as ``["comm=bf16", "recurrence=fp32,update=fp64"]``."""
    if items is None:
        return {}
    if isinstance(items, Mapping):
        return {str(k): str(v) for k, v in items.items()}
    out: dict[str, str] = {}
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            slot, sep, value = part.partition("=")
            if not sep or not slot.strip() or not value.strip():
                raise ArgumentError(f"slot override {part!r} is not of the form SLOT=PRECISION")
            out[slot.strip()] = value.strip()
    return out


def get_recipe(
    recipe: str | Recipe | Mapping[str, str] = "fp32",
    slots: Iterable[str] | Mapping[str, str] | None = None,
) -> Recipe:
    """Resolve a preset name, a :class:`Recipe` or a slot mapping, then apply overrides.

    Parameters
    ----------
    recipe : str, Recipe or mapping
        A preset name (``fp64``, ``fp32``, ``C``, ``D``; case-insensitive), a recipe, or
        a mapping of slot -> precision (unnamed slots default to fp32).
    slots : iterable of str or mapping, optional
        Overrides such as ``["comm=bf16"]`` or ``{"recurrence": "bf16"}``.

    Raises
    ------
    ValueError
        For an unknown preset, slot or precision.
    """
    if isinstance(recipe, Recipe):
        base = recipe
    elif isinstance(recipe, Mapping):
        fields = dict(recipe)
        name = str(fields.pop("name", "custom"))
        base = RECIPES["fp32"].with_slots(fields)
        base = dataclasses.replace(base, name=name)
    else:
        key = {k.lower(): k for k in RECIPES}.get(str(recipe).lower())
        if key is None:
            raise ArgumentError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
        base = RECIPES[key]
    return base.with_slots(parse_slots(slots))
