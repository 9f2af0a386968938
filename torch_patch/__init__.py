"""torch_patch: the pytree-family patch series for PyTorch 2.13, 2.14 and 2.15, and the
`torch-patch` tool. Each verb is a function here: ``apply``, ``revert``, ``status``,
``stock_file_path``, ``export``, ``dev_create``, ``dev_export``. Importing it imports no torch."""

__version__ = "0.1.0"  # setup.py reads it

from .core import (EXIT_APPLIED, EXIT_BASE_MISMATCH, EXIT_ERROR, EXIT_MODIFIED,  # noqa: F401
                   EXIT_NOT_APPLIED, EXIT_PARTLY, EXIT_SIGINT, RELEASE_LINES, Status,
                   TorchPatchError, apply, load_series, revert, status, stock_file_path)
from .dev import dev_create, dev_export, export  # noqa: F401
