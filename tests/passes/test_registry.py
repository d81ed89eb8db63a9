import pytest

from passes.base import GraphPass
from passes.registry import (
    CANONICAL_ORDER,
    order_passes,
    register_pass,
    registered_passes,
    resolve_pass,
)


def test_every_canonical_pass_is_registered_under_its_name():
    registry = registered_passes()
    for name in CANONICAL_ORDER:
        assert registry[name].name == name
        assert resolve_pass(name) is registry[name]


def test_unknown_name_lists_registered_passes():
    with pytest.raises(ValueError, match=r"unknown pass 'fuse_everything'.*noop_elimination"):
        resolve_pass("fuse_everything")


@pytest.mark.parametrize(
    "path, msg",
    [
        ("no_such_module_xyz:Pass", "cannot import module 'no_such_module_xyz'"),
        ("oot_pass_example:Missing", "has no attribute 'Missing'"),
        ("oot_pass_example:aten", "is not a subclass of passes.base.GraphPass"),
        (":Pass", "expected 'module.sub:ClassName'"),
    ],
)
def test_bad_import_paths_are_clear_errors(path, msg):
    with pytest.raises(ValueError, match=msg):
        resolve_pass(path)


def test_import_path_resolves_an_unregistered_pass():
    cls = resolve_pass("oot_pass_example:SubToAddNeg")
    assert issubclass(cls, GraphPass) and cls.name == "oot_pass_example:SubToAddNeg"


def test_order_keeps_canonical_order_and_fix_functionalization_last():
    names = [
        "fix_functionalization",
        "fuse_silu_mul_quant",
        "my.mod:Pass",
        "noop_elimination",
        "fuse_add_rmsnorm",
    ]
    # An out-of-tree pass runs right after the built-in written before it.
    assert order_passes(names) == [
        "noop_elimination",
        "fuse_add_rmsnorm",
        "fuse_silu_mul_quant",
        "my.mod:Pass",
        "fix_functionalization",
    ]
    assert order_passes(["my.mod:First", "noop_elimination"]) == [
        "my.mod:First",
        "noop_elimination",
    ]
    # PassConfig.enable appends at the end; ordering puts it where it belongs.
    assert order_passes(["noop_elimination", "fix_functionalization", "fuse_rmsnorm_quant"]) == [
        "noop_elimination",
        "fuse_rmsnorm_quant",
        "fix_functionalization",
    ]


def test_register_pass_rejects_non_passes_and_name_clashes():
    with pytest.raises(TypeError, match="not a GraphPass"):
        register_pass("x_not_a_pass")(object)
    with pytest.raises(ValueError, match="already used by"):

        @register_pass("noop_elimination")
        class Other(GraphPass):
            pass
