"""Only the optional C extension; everything else is in pyproject.toml.

``optional=True``: where it cannot be compiled (no C compiler), the install goes on without it
and envfleet runs its Python step path (see src/envfleet/_core/native.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "envfleet._core._speedups",
            sources=["src/envfleet/_core/_speedups.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
