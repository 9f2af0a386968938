import re

from setuptools import setup


_TEST_CORE = [
    "pytest",
    "expecttest",
    "hypothesis",
    "optree",
    "numpy",
    # test/onnx and the demo: torch.onnx.export(dynamo=True), onnxruntime
    "onnx",
    "onnxscript",
    "onnxruntime",
]

setup(
    name="torch_patch",
    version=re.search(r'__version__ = "(.+)"', open("torch_patch/__init__.py", encoding="utf-8").read())[1],
    description="Pytree families for PyTorch 2.13, 2.14 and 2.15, shipped as git patch series, and the torch-patch tool",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=["torch_patch"],
    # one series per release line: patches/<line>/series and its patches
    package_data={"torch_patch": ["patches/*/series", "patches/*/*.patch"]},
    include_package_data=False,
    python_requires=">=3.10",
    # the release lines with a series (torch_patch/patches/<line>/); pin the release you want
    # (pip would take the newest, a CUDA build of several GB)
    install_requires=["torch>=2.13.0,<2.16"],
    extras_require={
        # everything the tests need but transformers and diffusers, as in
        # PyTorch's CI (nox -s tests-ci-pins)
        "test-core": _TEST_CORE,
        "test": _TEST_CORE + ["transformers"],
    },
    entry_points={"console_scripts": ["torch-patch = torch_patch.cli:main"]},
)
