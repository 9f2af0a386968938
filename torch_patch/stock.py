"""Stock torch in a venv whose torch `torch-patch apply` patched, for the demo's stock column:
``install(stock_modules())``, before torch, imports the modules the series changes from the stock
files it saved."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from typing import Dict, Optional

from . import core


def stock_modules(target: Optional[os.PathLike] = None) -> Dict[str, Optional[str]]:
    """Each module the applied series touches: its saved stock file (None: the series adds it)."""
    st = core.status(target)
    if st.code != core.EXIT_APPLIED or not st.stock_files:  # not applied, or applied by other means
        raise core.TorchPatchError(f"the torch at {st.target} is not patched by torch-patch:\n"
                                   f"{st.message}\nRun `torch-patch apply` first, then this again.",
                                   st.code or core.EXIT_ERROR)
    return {rel[:-3].replace("/", ".").removesuffix(".__init__"): st.stock_files.get(rel)
            for rel in st.files if rel.endswith(".py")}


class _Loader(importlib.machinery.SourceFileLoader):
    def set_data(self, *args, **kwargs) -> None:  # no bytecode in the state dir
        pass


class StockFinder:
    def __init__(self, modules: Dict[str, Optional[str]]):
        self.modules = modules

    def find_spec(self, name, path=None, target=None):
        if name not in self.modules:
            return None
        stock = self.modules[name]
        if stock is None:  # the series adds it: stock torch has no such module
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        package = None
        if os.path.basename(stock) == "__init__.py":  # its submodules are the installed ones
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            package = list(spec.submodule_search_locations) if spec else None
        return importlib.util.spec_from_file_location(
            name, stock, loader=_Loader(name, stock), submodule_search_locations=package)


def install(modules: Dict[str, Optional[str]]) -> StockFinder:
    """Serve ``modules`` (from :func:`stock_modules`) from their stock files, before torch."""
    imported = sorted(name for name in modules if name in sys.modules)
    if imported:
        raise RuntimeError(f"{', '.join(imported)} already imported: install the stock finder "
                           "before torch")
    finder = StockFinder(modules)
    sys.meta_path.insert(0, finder)
    return finder
