"""Build of the one compiled module (the rest of the package is in pyproject.toml).

``gateway.routing._ckeys`` computes the canonical block keys in C (gateway/routing/keys.py
falls back to its numpy path when it is missing). It is optional here so that the package
still installs where no C compiler exists; ``scripts/setup`` and the Dockerfile check that it
was built and fail loudly if not.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gateway.routing._ckeys",
            sources=["gateway/routing/_keys.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit"],
            optional=True,
        )
    ]
)
