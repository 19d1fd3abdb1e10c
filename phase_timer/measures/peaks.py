"""Dense tensor-core peaks by device and precision: the denominator of MFU.

Every figure is *dense*.  NVIDIA's datasheets since Ampere print the tensor-core figures with
sparsity (2:4 structured sparsity, an asterisk: "* With sparsity") beside or instead of the
dense ones; a training run's matmuls are dense, so those are halved here and the row says so.
AMD's datasheets print dense and sparse figures separately; the dense one is taken.

An unknown device, or a precision the device has no peak for (bf16 on a V100 or a T4), gives
None: never another device's peak.  The user passes ``peak_tflops=`` instead.

``fp32`` is the plain FP32 peak (CUDA cores on NVIDIA, the matrix cores' FP32 on AMD); ``tf32``
is used for an fp32 run when fp32 matmuls may use TensorFloat-32 (:func:`tf32_allowed`) and the
device has it (Ampere and later; on Volta and Turing the flag does nothing, so fp32 stays).
``fp8`` is flagged: an fp8 run does only some of its matmuls in fp8 (attention and the rest in
bf16), so no one peak is right for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

#: A peak's precision keys.
BF16, FP16, TF32, FP32, FP8 = "bf16", "fp16", "tf32", "fp32", "fp8"

FP8_NOTE = ("fp8 peak: only the fp8 matmuls run at it (attention and the rest stay in bf16), "
            "so MFU against it understates and against bf16's overstates")


@dataclass(frozen=True)
class Peak:
    """A device's dense peak for one precision.

    Attributes:
        tflops: the dense peak, in TFLOP/s (1e12 FLOP/s), for one device as torch sees it.
        precision: the precision key used (``bf16``, ``fp16``, ``tf32``, ``fp32``, ``fp8``).
        device: the table's name for the device matched (``H100 SXM``).
        source: where the figure comes from.
        note: a caveat to print beside it (fp8; a device torch sees as half a package), or None.
    """

    tflops: float
    precision: str
    device: str
    source: str
    note: str | None = None


@dataclass(frozen=True)
class _Row:
    device: str
    tflops: dict[str, float]
    source: str
    note: str | None = None


_NV_SPARSE = "; tensor-core figures printed with sparsity (*), halved"
_A100 = {BF16: 312.0, FP16: 312.0, TF32: 156.0, FP32: 19.5}
_A100_SRC = "NVIDIA A100 datasheet, any form (BF16/FP16 312 | 624*, TF32 156 | 312*, FP32 19.5)"
_H100_WP = "NVIDIA H100 Tensor Core GPU Architecture whitepaper, dense column (SXM5)"

# Name matchers run on the upper-cased device name with "-" and "_" as spaces, in order: the first
# match wins, so the narrower names (V100S before V100, GB200 before B200) come first.
_ROWS: tuple[tuple[str, _Row], ...] = (
    # Volta: fp16 tensor cores only (no bf16, no TF32).
    (r"\bV100S\b", _Row("V100S PCIe", {FP16: 130.0, FP32: 16.4},
                        "NVIDIA Tesla V100S datasheet (tensor 130 TFLOPS, FP32 16.4)")),
    (r"\bV100\b.*\bSXM2\b", _Row("V100 SXM2", {FP16: 125.0, FP32: 15.7},
                                "NVIDIA Tesla V100 datasheet, SXM2 (tensor 125 TFLOPS, FP32 15.7)")),
    (r"\bV100\b.*\bPCIE\b", _Row("V100 PCIe", {FP16: 112.0, FP32: 14.0},
                                "NVIDIA Tesla V100 datasheet, PCIe (tensor 112 TFLOPS, FP32 14)")),
    # Turing: fp16 tensor cores only.
    (r"\bT4\b", _Row("T4", {FP16: 65.0, FP32: 8.1},
                     "NVIDIA T4 datasheet (mixed precision FP16/FP32 65 TFLOPS, FP32 8.1)")),
    # Ampere.  The datasheet gives the PCIe and SXM A100, 40 and 80 GB, the same peaks.
    (r"\bA100\b.*\bSXM", _Row("A100 SXM", _A100, _A100_SRC)),
    (r"\bA100\b.*\bPCIE\b", _Row("A100 PCIe", _A100, _A100_SRC)),
    (r"\bA100\b", _Row("A100", _A100, _A100_SRC)),
    (r"\bA10\b", _Row("A10", {BF16: 125.0, FP16: 125.0, TF32: 62.5, FP32: 31.2},
                      "NVIDIA A10 datasheet (BF16/FP16 125 | 250*, TF32 62.5 | 125*, FP32 31.2)")),
    # Ada.
    (r"\bL4\b", _Row("L4", {BF16: 121.0, FP16: 121.0, TF32: 60.0, FP8: 242.5, FP32: 30.3},
                     "NVIDIA L4 datasheet (BF16/FP16 242*, TF32 120*, FP8 485*, FP32 30.3)" + _NV_SPARSE)),
    (r"\bL40S\b", _Row("L40S", {BF16: 362.05, FP16: 362.05, TF32: 183.0, FP8: 733.0, FP32: 91.6},
                       "NVIDIA L40S datasheet (BF16/FP16 362.05 | 733*, TF32 183 | 366*, FP8 733 | 1466*, "
                       "FP32 91.6)")),
    # Hopper.  get_device_name(): "NVIDIA H100 80GB HBM3" is the SXM5 part; the PCIe part says PCIe
    # (its memory is HBM2e), the NVL part NVL.  A bare "H100" is none of them for sure: no match.
    (r"\bH100\b.*\bNVL\b", _Row("H100 NVL", {BF16: 835.5, FP16: 835.5, TF32: 417.5, FP8: 1670.5, FP32: 60.0},
                                "NVIDIA H100 NVL datasheet (BF16/FP16 1671*, TF32 835*, FP8 3341*, FP32 60)"
                                + _NV_SPARSE)),
    (r"\bH100\b.*\bPCIE\b", _Row("H100 PCIe", {BF16: 756.5, FP16: 756.5, TF32: 378.0, FP8: 1513.0, FP32: 51.0},
                                 "NVIDIA H100 PCIe datasheet (BF16/FP16 1513*, TF32 756*, FP8 3026*, FP32 51)"
                                 + _NV_SPARSE)),
    (r"\bH100\b.*\b(SXM|SXM5|HBM3)\b", _Row("H100 SXM", {BF16: 989.4, FP16: 989.4, TF32: 494.7, FP8: 1978.9,
                                                         FP32: 66.9}, _H100_WP)),
    # H200: the H100 SXM's compute with more memory (datasheet: BF16 1979*, TF32 989*, FP8 3958*, FP32 67).
    (r"\bH200\b.*\bNVL\b", _Row("H200 NVL", {BF16: 835.5, FP16: 835.5, TF32: 417.5, FP8: 1670.5, FP32: 60.0},
                                "NVIDIA H200 NVL datasheet (BF16/FP16 1671*, TF32 835*, FP8 3341*, FP32 60)"
                                + _NV_SPARSE)),
    (r"\bH200\b", _Row("H200 SXM", {BF16: 989.4, FP16: 989.4, TF32: 494.7, FP8: 1978.9, FP32: 66.9},
                       "NVIDIA H200 datasheet (BF16/FP16 1979*, TF32 989*, FP8 3958*, FP32 67); dense as "
                       + _H100_WP)),
    (r"\bGH200\b", _Row("GH200", {BF16: 989.4, FP16: 989.4, TF32: 494.7, FP8: 1978.9, FP32: 66.9},
                        "NVIDIA GH200 datasheet (the H100 SXM's 1979*/989*/3958*); dense as " + _H100_WP)),
    # Blackwell: the datasheets give systems; a GPU's share of the system's figure, halved for sparsity.
    (r"\bGB200\b", _Row("GB200", {BF16: 2500.0, FP16: 2500.0, TF32: 1250.0, FP8: 5000.0, FP32: 80.0},
                        "NVIDIA GB200 NVL72 datasheet / 72 GPUs (BF16/FP16 360 PF*, TF32 180 PF*, FP8 720 PF*, "
                        "FP32 5760 TF)" + _NV_SPARSE)),
    (r"\bB200\b", _Row("B200", {BF16: 2250.0, FP16: 2250.0, TF32: 1125.0, FP8: 4500.0, FP32: 75.0},
                       "NVIDIA HGX B200 datasheet / 8 GPUs (BF16/FP16 36 PF*, TF32 18 PF*, FP8 72 PF*, FP32 600 TF)"
                       + _NV_SPARSE)),
    # AMD CDNA3: dense figures printed as such.  TF32 ("xf32") is left out: PyTorch's fp32 matmuls
    # use it on ROCm only where hipBLASLt is told to, which the torch flags do not say.
    (r"\bMI325X\b", _Row("MI325X", {BF16: 1307.4, FP16: 1307.4, FP8: 2614.9, FP32: 163.4},
                         "AMD Instinct MI325X datasheet (FP16/BF16 1307.4, FP8 2614.9, FP32 matrix 163.4; dense)")),
    (r"\bMI300X\b", _Row("MI300X", {BF16: 1307.4, FP16: 1307.4, FP8: 2614.9, FP32: 163.4},
                         "AMD Instinct MI300X datasheet (FP16/BF16 1307.4, FP8 2614.9, FP32 matrix 163.4; dense)")),
    # AMD CDNA2: one MI250X or MI250 is two GCDs, and torch sees each GCD as a device: half the package.
    (r"\bMI250X\b(?!\s*/)", _Row("MI250X (one GCD)", {BF16: 191.5, FP16: 191.5, FP32: 47.85},
                                  "AMD Instinct MI250X datasheet (FP16/BF16 383, FP32 matrix 95.7 per package), "
                                  "halved: torch sees one of its two GCDs", "one GCD: half an MI250X")),
    (r"\bMI250\b", _Row("MI250 (one GCD)", {BF16: 181.05, FP16: 181.05, FP32: 45.25},
                        "AMD Instinct MI250 datasheet (FP16/BF16 362.1, FP32 matrix 90.5 per package), "
                        "halved: torch sees one of its two GCDs", "one GCD: half an MI250")),
)

# ROCm names both parts "AMD Instinct MI250X/MI250"; their GCDs differ in compute units.
_MI250_AMBIGUOUS = r"\bMI250X\s*/\s*MI250\b"
_MI250_BY_CUS = {110: r"\bMI250X\b(?!\s*/)", 104: r"\bMI250\b"}

_COMPILED = tuple((re.compile(pattern), row) for pattern, row in _ROWS)


def _normal(name: str) -> str:
    return re.sub(r"[-_]", " ", name.upper())


def _row(device_name: str, compute_units: int | None) -> _Row | None:
    name = _normal(device_name)
    if re.search(_MI250_AMBIGUOUS, name):
        pattern = _MI250_BY_CUS.get(compute_units) if compute_units is not None else None
        return dict(_ROWS).get(pattern) if pattern else None
    for pattern, row in _COMPILED:
        if pattern.search(name):
            return row
    return None


def precision_key(precision: str | None, *, tf32: bool) -> str | None:
    """The peak table's key for a run's precision string (Lightning's, or ``runinfo.precision_name``'s).

    ``bf16-mixed``/``bf16-true`` -> ``bf16``; ``16-mixed``/``16-true`` -> ``fp16``; ``32-true`` ->
    ``tf32`` when ``tf32`` (fp32 matmuls may use TF32) else ``fp32``; ``transformer-engine*``/``fp8``
    -> ``fp8``; anything else (``64-true``, None) -> None.
    """
    if precision is None:
        return None
    p = str(precision).strip().lower()
    if p.startswith("transformer-engine") or "fp8" in p or "float8" in p:
        return FP8
    head = p.split("-")[0]
    if head in ("bf16", "bfloat16"):
        return BF16
    if head in ("16", "fp16", "float16", "half"):
        return FP16
    if head in ("32", "fp32", "float32", "float", "tf32"):
        return TF32 if tf32 or head == "tf32" else FP32
    return None


def peak_tflops(device_name: str, precision: str, *, compute_units: int | None = None) -> Peak | None:
    """The dense peak for ``device_name`` (as ``torch.cuda.get_device_name()`` says it) at ``precision``.

    ``precision`` is a key (``bf16``, ``fp16``, ``tf32``, ``fp32``, ``fp8``; :func:`precision_key`
    makes one from a run's precision string).  ``tf32`` on a device without TF32 (V100, T4) is its
    fp32 peak: the flag does nothing there.  ``compute_units`` (the device's
    ``multi_processor_count``) tells an MI250X's GCD from an MI250's where ROCm names both alike.
    None: the device is not in the table, or has no peak at this precision (bf16 on a V100).
    """
    row = _row(device_name, compute_units)
    if row is None:
        return None
    key = precision
    if key == TF32 and TF32 not in row.tflops:
        key = FP32
    if key not in row.tflops:
        return None
    note = FP8_NOTE if key == FP8 else row.note
    return Peak(row.tflops[key], key, row.device, row.source, note)


def tf32_allowed() -> bool:
    """Whether fp32 matmuls may use TF32 now: torch's new ``fp32_precision`` flag where it has one,
    else ``torch.get_float32_matmul_precision()`` ("high" and "medium" allow it).  Read on the host
    (a flag, no device call), once per run.  Reading the legacy ``allow_tf32`` can raise where the
    legacy and new APIs were mixed, so it is never read first."""
    try:
        new = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
        if new == "none":  # inherits the backends' global setting
            new = getattr(torch.backends, "fp32_precision", "none")
        if new in ("tf32", "ieee"):
            return new == "tf32"
    except (AttributeError, RuntimeError):
        pass
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # the legacy and new APIs mixed: the new one said neither
        return False
