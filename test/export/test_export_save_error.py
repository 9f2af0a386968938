# Owner(s): ["oncall: export"]

"""A torch.export.save that fails leaves no file: no partial archive at a new
path, and an earlier program at the same path as it was."""

import os
import tempfile

import torch
from torch.testing._internal.common_utils import run_tests, TestCase


class TestExportSaveError(TestCase):
    def test_a_failed_save_leaves_no_file(self) -> None:
        x = torch.arange(3.0)
        ep = torch.export.export(torch.nn.Linear(3, 2), (x,))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.pt2")
            torch.export.save(ep, path, extra_files={"notes.txt": "v1"})
            with open(path, "rb") as f:
                earlier = f.read()
            for target in (path, os.path.join(tmp, "other.pt2")):
                # fails after the program is written: an extra file is a str
                with (
                    self.subTest(target=target),
                    self.assertRaisesRegex(AssertionError, "Expected string"),
                ):
                    torch.export.save(ep, target, extra_files={"notes.txt": 2})
            self.assertEqual(os.listdir(tmp), ["model.pt2"])
            with open(path, "rb") as f:
                self.assertEqual(f.read(), earlier)
            extra_files = {"notes.txt": ""}
            loaded = torch.export.load(path, extra_files=extra_files)
            self.assertEqual(extra_files, {"notes.txt": "v1"})
            self.assertEqual(loaded.module()(x), ep.module()(x))


if __name__ == "__main__":
    run_tests()
