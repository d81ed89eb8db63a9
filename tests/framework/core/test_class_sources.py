"""One walker from a class to the modules (and files) of our code that define it."""

import torch

from framework.core.class_sources import class_modules, class_source_files
from passes.fuse_add_rmsnorm import FuseAddRMSNormPass


class _Local(torch.nn.Linear):
    pass


def test_class_modules_follow_the_mro_and_skip_torch_and_the_stdlib():
    assert class_modules(FuseAddRMSNormPass) == [
        "passes.fuse_add_rmsnorm",
        "passes.pattern_fusion",
        "passes.base",
    ]
    assert class_modules(_Local) == [__name__]


def test_class_source_files_are_the_modules_files():
    files = class_source_files([_Local, _Local, FuseAddRMSNormPass, torch.nn.ReLU])
    assert [f.rsplit("/", 2)[-2:] for f in files] == [
        ["passes", "base.py"],
        ["passes", "fuse_add_rmsnorm.py"],
        ["passes", "pattern_fusion.py"],
        ["core", "test_class_sources.py"],
    ]
