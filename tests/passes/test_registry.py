import pytest

from passes.base import GraphPass
from passes.registry import (
    canonical_order,
    order_passes,
    register_pass,
    registered_passes,
    resolve_pass,
)


def test_every_canonical_pass_is_registered_under_its_name():
    registry = registered_passes()
    for name in canonical_order():
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
        ("oot_pass_example:aten", "is neither a GraphPass subclass"),
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
    # A +name edit of PassConfig.passes appends at the end; ordering puts it where it belongs.
    assert order_passes(["noop_elimination", "fix_functionalization", "fuse_rmsnorm_quant"]) == [
        "noop_elimination",
        "fuse_rmsnorm_quant",
        "fix_functionalization",
    ]


def test_register_pass_rejects_non_passes_and_name_clashes():
    with pytest.raises(TypeError, match="neither a GraphPass subclass"):
        register_pass("x_not_a_pass")(object)
    with pytest.raises(TypeError, match="neither a GraphPass subclass"):
        register_pass("x_not_a_pass")(3)
    with pytest.raises(ValueError, match="already registered by"):

        @register_pass("noop_elimination")
        class Other(GraphPass):
            pass


def test_metadata_on_the_pass_derives_order_levels_and_fusion_flag():
    from passes.registry import ALL, PASSES, level_passes, pass_meta

    assert pass_meta("fix_functionalization")["after"] == (ALL,)
    assert pass_meta("fuse_rmsnorm_quant")["levels"] == {"cpu": 3, "cuda": 1}
    assert resolve_pass("fuse_add_rmsnorm").is_fusion
    assert not resolve_pass("noop_elimination").is_fusion

    @register_pass("zz_test_late", after=("fuse_add_rmsnorm",), levels={"cuda": 2}, fusion=True)
    class Late(GraphPass):
        pass

    try:
        order = canonical_order()
        assert order.index("fuse_add_rmsnorm") < order.index("zz_test_late")
        assert order[-1] == "fix_functionalization"  # after=ALL stays last
        assert "zz_test_late" in level_passes(2, "cuda")
        assert "zz_test_late" not in level_passes(1, "cuda") + level_passes(3, "cpu")
        assert Late.is_fusion
        assert order_passes(["fix_functionalization", "zz_test_late", "noop_elimination"]) == [
            "noop_elimination",
            "zz_test_late",
            "fix_functionalization",
        ]
    finally:
        PASSES.remove("zz_test_late")
    assert "zz_test_late" not in canonical_order()


def test_bad_metadata_is_a_clear_error():
    from passes.registry import PASSES

    with pytest.raises(ValueError, match="lowest level 1, 2 or 3"):
        register_pass("zz_bad_level", levels={"cuda": 0})
    with pytest.raises(ValueError, match="after=ALL cannot name"):
        register_pass("zz_bad_after", after=("*", "noop_elimination"))

    @register_pass("zz_dangling", after=("no_such_pass",))
    class Dangling(GraphPass):
        pass

    try:
        with pytest.raises(ValueError, match=r"'zz_dangling'.*unregistered pass\(es\) \['no_such"):
            canonical_order()
    finally:
        PASSES.remove("zz_dangling")

    @register_pass("zz_a", after=("zz_b",))
    class A(GraphPass):
        pass

    @register_pass("zz_b", after=("zz_a",))
    class B(GraphPass):
        pass

    try:
        with pytest.raises(ValueError, match="form a cycle"):
            canonical_order()
    finally:
        PASSES.remove("zz_a")
        PASSES.remove("zz_b")


def test_an_entry_point_class_without_metadata_runs_only_when_named():
    """What Registry does for a ``piecewise.passes`` entry point naming a class that did not
    register itself: no levels (never a default), ordered before after=ALL passes."""
    from passes.registry import PASSES, level_passes

    class Plugin(GraphPass):
        pass

    PASSES.add("zz_plugin", Plugin, plugin="pkg.mod:Plugin")
    try:
        assert resolve_pass("zz_plugin") is Plugin and Plugin.name == "zz_plugin"
        order = canonical_order()
        assert order[-2:] == ["zz_plugin", "fix_functionalization"]
        assert all(
            "zz_plugin" not in level_passes(lvl, d) for lvl in (1, 2, 3) for d in "cpu cuda".split()
        )
    finally:
        PASSES.remove("zz_plugin")
