"""Maps the repository layout onto one import root: core/ -> kvloom, registry/ -> kvloom.registry."""

from setuptools import find_packages, setup

packages = ["kvloom"] + [f"kvloom.{p}" for p in find_packages("core")]
packages += ["kvloom.registry"] + [f"kvloom.registry.{p}" for p in find_packages("registry")]

setup(
    packages=packages,
    package_dir={"kvloom": "core", "kvloom.registry": "registry"},
    package_data={"kvloom": ["py.typed"]},
)
