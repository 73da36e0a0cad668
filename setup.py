"""Package layout: the shared library lives in libs/kvmesh, the services in services/.

Both install under one import root, ``kvmesh``: ``kvmesh.model``, ``kvmesh.rpc`` ... from libs/,
``kvmesh.services.engine`` ... from services/, the benchmarks as ``kvmesh.loadtest`` from loadtest/. Generated gRPC stubs land in libs/kvmesh/<svc>/v1/
(see kvmesh/protogen.py) and are not committed.
"""
from setuptools import find_namespace_packages, setup

libs = ["kvmesh"] + ["kvmesh." + p for p in find_namespace_packages("libs/kvmesh")]
services = ["kvmesh.services"] + ["kvmesh.services." + p for p in find_namespace_packages("services")]
loadtest = ["kvmesh.loadtest"] + ["kvmesh.loadtest." + p for p in find_namespace_packages("loadtest")]

setup(
    packages=[p for p in libs + services + loadtest if "__pycache__" not in p],
    package_dir={"kvmesh": "libs/kvmesh", "kvmesh.services": "services", "kvmesh.loadtest": "loadtest"},
    package_data={"kvmesh": ["py.typed"]},
)
