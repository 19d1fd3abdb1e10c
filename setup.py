"""Builds the optional C extension (phase_timer/_native.c, which includes its parts from phase_timer/native/);
everything else is in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and phase-timer
times with torch's events instead (same numbers, more host time per step).
"""

from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "phase_timer._native",
            sources=["phase_timer/_native.c"],
            depends=sorted(glob("phase_timer/native/*.c")),  # one translation unit: a part changed rebuilds it
            libraries=["dl", "m", "pthread"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
