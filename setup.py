"""Builds the optional C clock (phase_timer/_native.c); everything else is in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and phase-timer
times with torch's events instead (same numbers, more host time per step).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "phase_timer._native",
            sources=["phase_timer/_native.c"],
            libraries=["dl", "m", "pthread"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
