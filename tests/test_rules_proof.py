"""A chain is fused only when the graph proves it is the op: group Reshape targets, declared shapes that
lie, symbolic widths, and shape arithmetic the rule follows (fusion/shapes/arith.py).

The property test generates the first Reshape's target from every kind of element (constants, -1, 0,
Shape of the product) over leading shapes with one row per position and with several: the chain is
fused exactly when the target provably groups C-wide rows into groups of gs, and a fused model always
computes what the original does.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import contrib_ops
from fusion._chains import ChainSpec, build_chain, chain_inputs
from fusion.rewrite import rewrite_model
from fusion.shapes import arith as _arith
from fusion.shapes.dims import forward_dims

CHANNELS, GROUP_SIZE = 64, 16
GROUPS = CHANNELS // GROUP_SIZE


def _outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, use_library: bool) -> np.ndarray:
    return contrib_ops.session(model, use_library=use_library).run(None, feeds)[0]


def _fused_count(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if n.op_type == "GatedGroupRMSNorm")


def _assert_same_as_original(original: onnx.ModelProto, fused: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    want = _outputs(original, feeds, use_library=False)
    for use_library in (True, False):
        got = _outputs(fused, feeds, use_library=use_library)
        assert got.shape == want.shape
        scale = float(np.max(np.abs(want)))
        error = float(np.max(np.abs(got - want)))
        assert error <= 1e-5 * max(scale, 1.0), f"fused differs from the original by {error:.3g} (max {scale:.3g})"


# --- the three wrong fusions of the hardening issue -----------------------------------------------------


@pytest.mark.parametrize("target", [(2, GROUPS, -1), (GROUPS, -1), (0, GROUPS, -1)])
def test_group_target_ending_in_minus_one_over_several_rows_is_refused(target: tuple[int, ...]) -> None:
    """[B, G, -1] on [B, L, C] with L > 1 groups rows and channels together: not the op."""
    spec = ChainSpec(leading=(2, 3), group_target=target)
    model = build_chain(spec)
    feeds = chain_inputs(spec)
    fused, report = rewrite_model(model)
    assert report.fused == 0, report.summary()
    assert "could span rows" in report.refused[0][1]
    # and the original really is not the op: its groups span rows
    assert fused.SerializeToString() == model.SerializeToString()
    _outputs(model, feeds, use_library=False)


def test_group_target_ending_in_minus_one_with_rows_copied_fuses() -> None:
    """[0, 0, G, -1] and [L0, L1, G, -1] copy y's own leading dims: the group size C/G is proven."""
    for target in [(0, 0, GROUPS, -1), ("L0", "L1", GROUPS, -1)]:
        spec = ChainSpec(leading=(2, 3), group_target=target)
        model = build_chain(spec)
        fused, report = rewrite_model(model)
        assert report.fused == 1, report.summary()
        assert report.fused_chains[0]["group_size"] == GROUP_SIZE
        _assert_same_as_original(model, fused, chain_inputs(spec))


def test_group_shape_from_a_graph_input_is_not_proven_by_value_info() -> None:
    """value_info claims [.., 4, 16]; the target is a graph input that says otherwise at run time."""
    spec = ChainSpec(leading=(2, 3), group_target_as_input=True)
    model = build_chain(spec)
    fused, report = rewrite_model(model)
    assert report.fused == 0, report.summary()
    assert "not a constant or shape arithmetic" in report.refused[0][1]
    # the graph really computes something else when fed another grouping
    feeds = {**chain_inputs(spec), "group_shape": np.array([2, 3, 2, 32], np.int64)}
    other = _outputs(model, feeds, use_library=False)
    feeds["group_shape"] = np.array([2, 3, GROUPS, GROUP_SIZE], np.int64)
    assert not np.allclose(other, _outputs(model, feeds, use_library=False))


def _with_symbolic_width(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    value = next(i for i in model.graph.input if i.name == name)
    value.type.tensor_type.shape.dim[-1].ClearField("dim_value")
    value.type.tensor_type.shape.dim[-1].dim_param = "width"
    del model.graph.value_info[:]
    return onnx.shape_inference.infer_shapes(model, strict_mode=False)


@pytest.mark.parametrize("name", ["y", "z"])
def test_symbolic_width_of_one_input_runs_wherever_the_original_runs(name: str) -> None:
    """A symbolic last dim of y (or z) may be 1 and broadcast: the fused model must run it too."""
    spec = ChainSpec(leading=(2, 3))
    model = _with_symbolic_width(build_chain(spec), name)
    fused, report = rewrite_model(model)
    assert report.fused == 1, report.summary()
    for width in (CHANNELS, 1):
        feeds = chain_inputs(spec)
        feeds[name] = np.ascontiguousarray(feeds[name][..., :width])
        _assert_same_as_original(model, fused, feeds)


def test_proven_width_needs_no_broadcast_guard() -> None:
    spec = ChainSpec(leading=(2, 3))
    fused, report = rewrite_model(build_chain(spec))
    assert report.fused == 1
    assert not [n for n in fused.graph.node if n.op_type == "Expand"]


# --- shape arithmetic ---------------------------------------------------------------------------------


def _evaluate(expression: _arith.QuasiAffine, size: int) -> int:
    a, b = expression.pieces[size % expression.period]
    return a * (size // expression.period) + b


@pytest.mark.parametrize("chunk", [16, 128, 256])
def test_padded_length_arithmetic_is_proven_constant(chunk: int) -> None:
    """torch.export's chunked-scan width: 64 * Min(s, c * ((s + Mod(c - Mod(s, c), c)) // c)) // s, for the
    chunk sizes c of the tiny fixtures (16) and of real models (128, 256)."""
    s, c = _arith.QuasiAffine.of_symbol("seq"), _arith.QuasiAffine.constant
    padding = _arith.modulo(_arith.add(c(chunk), _arith.modulo(s, c(chunk)), sign=-1), c(chunk))
    padded = _arith.multiply(c(chunk), _arith.floor_divide(_arith.add(s, padding), c(chunk)))
    width = _arith.floor_divide(_arith.multiply(c(64), _arith.minimum(s, padded)), s)
    assert width is not None and width.as_constant() == 64
    assert _arith.minimum(s, padded).is_symbol()


def test_arithmetic_that_is_not_one_expression_is_not_proven() -> None:
    s, c = _arith.QuasiAffine.of_symbol("seq"), _arith.QuasiAffine.constant
    assert _arith.minimum(s, c(16)) is None  # crosses at s = 16
    assert _arith.multiply(s, s) is None
    assert _arith.floor_divide(c(64), s) is None  # not a multiple of s
    assert _arith.add(s, _arith.QuasiAffine.of_symbol("batch")) is None


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["add", "sub", "mul", "div", "mod"]), st.integers(1, 24)), max_size=5),
    st.integers(1, 300),
)
def test_quasi_affine_evaluates_like_python(steps: list[tuple[str, int]], size: int) -> None:
    """Every expression the algebra builds is exact at every size (checked at one random size)."""
    expression, value = _arith.QuasiAffine.of_symbol("s"), size
    for op, constant in steps:
        c = _arith.QuasiAffine.constant(constant)
        if op == "add":
            expression, value = _arith.add(expression, c), value + constant
        elif op == "sub":
            expression, value = _arith.add(expression, c, sign=-1), value - constant
        elif op == "mul":
            expression, value = _arith.multiply(expression, c), value * constant
        elif op == "div":
            expression, value = _arith.floor_divide(expression, c), value // constant
        else:
            expression, value = _arith.modulo(expression, c), value % constant
        if expression is None:
            return  # period cap: not followed, never wrong
    assert _evaluate(expression, size) == value


# --- property: fused <=> provably the op, and fused always matches --------------------------------------


@st.composite
def group_targets(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int | str, ...]]:
    """Return (leading dims of y, a group Reshape target that is valid for them) of every kind."""
    leading = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    rows = math.prod(leading)
    kind = draw(st.sampled_from(["copy", "flatten", "minus_one_last", "mixed"]))
    width = draw(st.sampled_from([GROUP_SIZE, 8, 32, CHANNELS]))
    groups = CHANNELS // width
    if kind == "copy":  # each leading element: constant, 0 or Shape(product)[i]
        lead = tuple(draw(st.sampled_from([d, 0, f"L{i}"])) for i, d in enumerate(leading))
        target: tuple[int | str, ...] = (*lead, groups, width)
    elif kind == "flatten":
        target = (-1, groups, width) if draw(st.booleans()) else (rows * groups, width)
    elif kind == "minus_one_last":
        lead_options = [tuple(f"L{i}" for i in range(len(leading))), leading, (leading[0],), ()]
        lead = draw(st.sampled_from(lead_options))
        # keep only targets the original can run: the element count must divide
        total = rows * CHANNELS
        if total % (max(math.prod(d for d in lead if isinstance(d, int)) if lead else 1, 1) * groups):
            lead = leading
        target = (*lead, groups, -1)
    else:
        lead = tuple(-1 if i == 0 else f"L{i}" for i in range(len(leading)))
        target = (*lead, groups, width)
    return leading, target


def _provably_the_op(leading: tuple[int, ...], target: tuple[int | str, ...]) -> int | None:
    """The test's own oracle: the group size when the target groups C-wide rows, else None."""
    last = target[-1]
    if isinstance(last, int) and last > 0:
        return last if CHANNELS % last == 0 else None
    lead, groups = target[:-2], target[-2]
    copies = len(lead) == len(leading) and all(d == f"L{i}" or d == 0 or d == leading[i] for i, d in enumerate(lead))
    static = all(isinstance(d, int) and d > 0 for d in lead) and math.prod(lead) == math.prod(leading)  # type: ignore[arg-type]
    return CHANNELS // groups if isinstance(groups, int) and (copies or static) else None


@settings(derandomize=True, max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group_targets())
def test_group_targets_fuse_exactly_when_proven(case: tuple[tuple[int, ...], tuple[int | str, ...]]) -> None:
    leading, target = case
    spec = ChainSpec(leading=leading, group_target=target)
    model = build_chain(spec)
    feeds = chain_inputs(spec)
    fused, report = rewrite_model(model)
    expected = _provably_the_op(leading, target)
    if expected is None:
        assert report.fused == 0, f"{target} on {leading}: fused but not provably the op"
        return
    assert report.fused == 1, f"{target} on {leading}: {report.summary()}"
    assert report.fused_chains[0]["group_size"] == expected
    _assert_same_as_original(model, fused, feeds)


def test_width_proven_by_shape_arithmetic() -> None:
    """y = Reshape(x, [1, s, 64 * Min(s, 16 * ceil(s / 16)) // s]) of a graph input x [1, s, 64]: the
    width is 64 for every s, which ONNX's inference does not see and the rule's arithmetic proves."""
    spec = ChainSpec(leading=(1, "seq"), shape_as="dynamic")
    model = build_chain(spec)
    graph = model.graph
    next(v for v in graph.input if v.name == "y").name = "x"
    ints = {"c64": 64, "c16": 16, "c1": 1, "c0": 0}
    graph.initializer.extend(onnx.numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items())
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([0], np.int64), "axis0"))
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "one_1d"))
    make = onnx.helper.make_node
    width_nodes = [
        make("Shape", ["x"], ["s_1d"], start=1, end=2),
        make("Concat", ["one_1d", "s_1d"], ["lead"], axis=0),
        make("Squeeze", ["s_1d", "axis0"], ["s"]),
        make("Mod", ["s", "c16"], ["r"]),
        make("Sub", ["c16", "r"], ["pad0"]),
        make("Mod", ["pad0", "c16"], ["pad"]),
        make("Add", ["s", "pad"], ["padded0"]),
        make("Div", ["padded0", "c16"], ["chunks"]),
        make("Mul", ["chunks", "c16"], ["padded"]),
        make("Min", ["s", "padded"], ["kept"]),
        make("Mul", ["kept", "c64"], ["numel"]),
        make("Div", ["numel", "s"], ["width"]),
        make("Unsqueeze", ["width", "axis0"], ["width_1d"]),
        make("Concat", ["lead", "width_1d"], ["y_shape"], axis=0),
        make("Reshape", ["x", "y_shape"], ["y"]),
    ]
    for node in reversed(width_nodes):
        graph.node.insert(0, node)
    del graph.value_info[:]
    ir_model = ir.from_proto(model)
    y = next(v for node in ir_model.graph for v in node.outputs if v.name == "y")
    assert y.shape is None  # nothing declared: the proof comes from the graph alone
    assert forward_dims(y) == [1, "seq", 64]
    # an expression that is not the same for every length is not proven: the width is unknown (the rank
    # and the other dims are the target's wherever the Reshape runs)
    graph.node.remove(next(n for n in graph.node if n.output[0] == "kept"))
    graph.node.insert(0, onnx.helper.make_node("Min", ["s", "c16"], ["kept"]))
    ir_model = ir.from_proto(model)
    y = next(v for node in ir_model.graph for v in node.outputs if v.name == "y")
    assert forward_dims(y) == [1, "seq", None]


def test_assume_equal_widths_drops_the_guard_and_rejects_width_one_loudly() -> None:
    """The opt-in: no Expand; a width-1 y then fails at run time with the kernel's shape error."""
    spec = ChainSpec(leading=(2, 3))
    model = _with_symbolic_width(build_chain(spec), "y")
    fused, report = rewrite_model(model, assume_equal_widths=True)
    assert report.fused == 1
    assert not [n for n in fused.graph.node if n.op_type == "Expand"]
    _assert_same_as_original(model, fused, chain_inputs(spec))
    feeds = chain_inputs(spec)
    feeds["y"] = np.ascontiguousarray(feeds["y"][..., :1])
    with pytest.raises(Exception, match="(?i)shape"):
        _outputs(fused, feeds, use_library=True)


# --- declared shapes of intermediate values are hints ------------------------------------------------


def _group_target_from(model: onnx.ModelProto, source: str) -> None:
    """Point the group Reshape's Shape nodes (its target's leading elements) at ``source``."""
    concat = next(n for n in model.graph.node if n.op_type == "Concat")
    for node in model.graph.node:
        if node.op_type == "Shape" and node.output[0] in concat.input:
            node.input[0] = source


def _insert_unproven_copy(graph: onnx.GraphProto, source: str, output: str) -> None:
    """output = source with its first element replaced (ScatterElements: an op whose output shape the rules
    do not derive, so only a declared shape could say it)."""
    zeros = np.zeros((1, 1, 1), np.int64)
    graph.initializer.append(onnx.numpy_helper.from_array(zeros, f"{output}_at"))
    graph.initializer.append(onnx.numpy_helper.from_array(np.full((1, 1, 1), 0.5, np.float32), f"{output}_value"))
    graph.node.insert(
        0, onnx.helper.make_node("ScatterElements", [source, f"{output}_at", f"{output}_value"], [output])
    )


def _rows_apart_feeds(*, y_name: str = "y", x_width: int = 5) -> dict[str, np.ndarray]:
    """y and z with two rows; x with one."""
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal((1, 2, CHANNELS)).astype(np.float32) for name in (y_name, "z")}
    feeds["x"] = rng.standard_normal((1, 1, x_width)).astype(np.float32)
    return feeds


def test_group_target_from_an_intermediate_with_declared_dims_is_not_proven() -> None:
    """The target's leading elements are Shape of an intermediate value whose value_info claims y's dims
    [B, L]; at run time it has one row where y has two, the original's -1 spans both rows, and a fusion
    with group size C / G would compute something else."""
    spec = ChainSpec(leading=("B", "L"), shape_as="dynamic", group_target=("L0", "L1", GROUPS, -1))
    model = build_chain(spec)
    graph = model.graph
    graph.input.append(onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["P", "Q", 5]))
    _insert_unproven_copy(graph, "x", "other")
    graph.value_info.append(onnx.helper.make_tensor_value_info("other", onnx.TensorProto.FLOAT, ["B", "L", 5]))
    _group_target_from(model, "other")
    fused, report = rewrite_model(model)
    assert report.fused == 0, report.summary()
    assert "not a constant or shape arithmetic" in report.refused[0][1]
    # what a fusion would have changed: the original groups 2 * C / G elements here, across the rows
    feeds = _rows_apart_feeds()
    grouped_by_c_over_g = _outputs(build_chain(spec), {k: feeds[k] for k in ("y", "z")}, use_library=False)
    assert not np.allclose(_outputs(model, feeds, use_library=False), grouped_by_c_over_g)


def test_leading_dims_declared_only_on_an_intermediate_y_are_not_evidence() -> None:
    """y comes from an op whose output shape the graph does not prove, with value_info [B, L, C]; the target
    copies a graph input's [B, L]. Equal names on an intermediate are a hint: at run time x has one row."""
    spec = ChainSpec(leading=("B", "L"), shape_as="dynamic", group_target=("L0", "L1", GROUPS, -1))
    model = build_chain(spec)
    graph = model.graph
    y_input = next(v for v in graph.input if v.name == "y")
    y_input.name = "y_in"
    y_input.type.tensor_type.shape.dim[0].dim_param = "P"
    y_input.type.tensor_type.shape.dim[1].dim_param = "Q"
    graph.input.append(onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", "L", 1]))
    _insert_unproven_copy(graph, "y_in", "y")
    del graph.value_info[:]
    graph.value_info.append(onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["B", "L", CHANNELS]))
    _group_target_from(model, "x")
    fused, report = rewrite_model(model)
    assert report.fused == 0, report.summary()
    assert "could span rows" in report.refused[0][1]
    # the same y behind the same op, with the target read from y itself: y's own dims, proven
    _group_target_from(model, "y")
    fused, report = rewrite_model(model)
    assert report.fused == 1, report.summary()
    feeds = _rows_apart_feeds(y_name="y_in", x_width=1)
    _assert_same_as_original(model, fused, feeds)


# --- an element the rule cannot follow, pinned by the element count (whole-model dynamo exports) --------

CHUNK = 8


def _padded_element(model: onnx.ModelProto, name: str, factor: int) -> None:
    """Replace the one-element int initializer ``name`` by torch's ``(factor * 8 * ceil(L / 8)) // L`` made 1-D,
    L from Shape(y)[1]: the group count (or width) a dynamo whole-model export writes from the SSD's padded
    length. It is ``factor`` at every multiple of 8 and at some other lengths, and no expression of L."""
    graph = model.graph
    kept = [t for t in graph.initializer if t.name != name]
    assert len(kept) == len(graph.initializer) - 1, name
    del graph.initializer[:]
    graph.initializer.extend(kept)
    ints = {f"{name}_c": CHUNK, f"{name}_f": factor * CHUNK, f"{name}_m1": -1}
    graph.initializer.extend(onnx.numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items())
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), f"{name}_flat"))
    make = onnx.helper.make_node
    c, p = f"{name}_c", name
    nodes = [
        make("Shape", ["y"], [f"{p}_s1"], start=1, end=2),
        make("Squeeze", [f"{p}_s1"], [f"{p}_s"]),
        make("Mod", [f"{p}_s", c], [f"{p}_r"]),
        make("Mul", [f"{name}_m1", f"{p}_r"], [f"{p}_nr"]),
        make("Add", [c, f"{p}_nr"], [f"{p}_pad0"]),
        make("Mod", [f"{p}_pad0", c], [f"{p}_pad"]),
        make("Add", [f"{p}_s", f"{p}_pad"], [f"{p}_padded"]),
        make("Div", [f"{p}_padded", c], [f"{p}_chunks"]),
        make("Mul", [f"{name}_f", f"{p}_chunks"], [f"{p}_total"]),
        make("Div", [f"{p}_total", f"{p}_s"], [f"{p}_scalar"]),
        make("Reshape", [f"{p}_scalar", f"{name}_flat"], [name]),
    ]
    for node in reversed(nodes):
        graph.node.insert(0, node)
    del graph.value_info[:]


def _padded_chain(target: tuple[int | str, ...], unknown: dict[int, int], restore_factor: int | None = None):
    """A chain on y [1, L, C] whose group target is ``target`` with element i replaced by the padded-length
    element of factor ``unknown[i]`` (and the second Reshape's last element too, when ``restore_factor``)."""
    spec = ChainSpec(leading=(1, "L"), shape_as="dynamic", group_target=target)
    model = build_chain(spec)
    for index, factor in unknown.items():
        _padded_element(model, f"group_target_{index}", factor)
    if restore_factor is not None:
        _padded_element(model, "tail_out", restore_factor)
    onnx.checker.check_model(model)
    return spec, model


def _runs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> bool:
    try:
        _outputs(model, feeds, use_library=False)
    except Exception:
        return False
    return True


def _assert_same_where_the_original_runs(spec: ChainSpec, model: onnx.ModelProto, fused: onnx.ModelProto) -> None:
    """Parity at every length 1..24 at which the original runs: each multiple of 8, and some others."""
    ran = []
    for length in range(1, 25):
        feeds = chain_inputs(spec, leading=(1, length))
        if _runs(model, feeds):
            _assert_same_as_original(model, fused, feeds)
            ran.append(length)
    assert {8, 16, 24} <= set(ran) and len(ran) < 24, ran  # the element is no constant: it fails somewhere


@pytest.mark.parametrize("restore", [False, True], ids=["restore-C", "restore-padded"])
def test_padded_group_count_between_proven_rows_and_a_constant_group_size_fuses(restore: bool) -> None:
    """[B, L, (8 * G * ceil(L / 8)) // L, gs] (issue 25's target): the interior element is unknown, the
    rows are y's and gs divides C, so every group is gs consecutive channels of one row."""
    spec, model = _padded_chain(("L0", "L1", 0, GROUP_SIZE), {2: GROUPS}, CHANNELS if restore else None)
    fused, report = rewrite_model(model)
    assert report.fused == 1, report.summary()
    assert report.fused_chains[0]["group_size"] == GROUP_SIZE
    # the restore is proven y's shape: no Reshape is kept after the fused node
    assert not [n for n in fused.graph.node if n.op_type == "Reshape" and n.input[0].startswith("gated")]
    _assert_same_where_the_original_runs(spec, model, fused)


def test_padded_last_element_after_proven_rows_and_groups_is_pinned_to_c_over_g() -> None:
    """[B, L, G, unknown]: the node runs only where B * L * G * last = B * L * C, i.e. last = C / G."""
    spec, model = _padded_chain(("L0", "L1", GROUPS, 0), {3: GROUP_SIZE})
    fused, report = rewrite_model(model)
    assert report.fused == 1, report.summary()
    assert report.fused_chains[0]["group_size"] == GROUP_SIZE
    _assert_same_where_the_original_runs(spec, model, fused)


@pytest.mark.parametrize(
    ("target", "unknown", "reason"),
    [
        # the unknown where a row dim belongs: its groups could take channels of several rows
        (("L0", 0, GROUPS, -1), {1: 1}, "could span rows"),
        ((0, "L1", GROUPS, 0), {0: 1, 3: GROUP_SIZE}, "could span rows"),
        # two elements left to the element count: the unknown and a -1, or two unknowns
        (("L0", "L1", 0, -1), {2: GROUPS}, "does not prove the group size"),
        (("L0", "L1", 0, 0), {2: GROUPS, 3: GROUP_SIZE}, "does not prove the group size"),
        # leading elements that are not y's leading dims
        ((GROUPS, 0), {1: GROUP_SIZE}, "could span rows"),
        (("L1", GROUPS, 0), {2: GROUP_SIZE}, "could span rows"),
        (("L1", "L0", GROUPS, 0), {3: GROUP_SIZE}, "could span rows"),
    ],
)
def test_unknown_elements_that_the_element_count_does_not_pin_are_refused(
    target: tuple[int | str, ...], unknown: dict[int, int], reason: str
) -> None:
    _, model = _padded_chain(target, unknown)
    fused, report = rewrite_model(model)
    assert report.fused == 0, report.summary()
    assert reason in report.refused[0][1], report.refused
    assert fused.SerializeToString() == model.SerializeToString()


def test_unknown_restore_element_beside_unproven_rows_is_refused() -> None:
    """The second Reshape [L1, L0, unknown] on y [1, L, C]: no element is pinned (its rows are not y's) and
    it does not end in C, so neither the proof nor the kept-Reshape path applies."""
    spec = ChainSpec(leading=(1, "L"), shape_as="dynamic")
    model = build_chain(spec)
    concat = next(n for n in model.graph.node if n.op_type == "Concat" and "tail_out" in n.input)
    concat.input[0], concat.input[1] = concat.input[1], concat.input[0]
    _padded_element(model, "tail_out", CHANNELS)
    fused, report = rewrite_model(model)
    assert report.fused == 0, report.summary()
    assert "does not provably restore" in report.refused[0][1], report.refused
