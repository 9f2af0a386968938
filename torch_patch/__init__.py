"""torch_patch: ship and apply the pytree-family patch series for PyTorch 2.13, 2.14 and 2.15.

Every CLI verb is a function here: ``apply``, ``revert``, ``status``, ``stock_file_path``,
``export``, ``dev_create``, ``dev_export``.  Importing this package does not import torch.
"""

from .core import (EXIT_APPLIED, EXIT_BASE_MISMATCH, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_MODIFIED,
                   EXIT_NOT_APPLIED, EXIT_SIGINT, EXPECTED_TORCH_VERSION, PATCHES_DIR, RELEASE_LINES,
                   Status, TorchPatchError, apply, load_series, release_line, revert, series_dir_for,
                   status, stock_file_path)
from .dev import dev_create, dev_export
from .export import export

__all__ = [
    "apply", "revert", "status", "stock_file_path", "export", "dev_create", "dev_export", "load_series",
    "Status", "TorchPatchError", "EXPECTED_TORCH_VERSION", "PATCHES_DIR",
    "RELEASE_LINES", "release_line", "series_dir_for",
    "EXIT_APPLIED", "EXIT_NOT_APPLIED", "EXIT_MODIFIED", "EXIT_BASE_MISMATCH", "EXIT_INTERRUPTED",
    "EXIT_ERROR", "EXIT_SIGINT",
]
