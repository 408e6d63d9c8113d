"""Forward shape inference (fusion/shapes/dims.py, ``ForwardShapes``): each op's proven output dims against
what ONNX Runtime produces, at sequence lengths that hit every residue the arithmetic distinguishes.

A proof the rewriter relies on must hold for every length: each case is a one-op (or few-op) model with a
symbolic ``seq``, its output's proven dims evaluated at several lengths and compared with the shape
ONNX Runtime actually returns. Cases the rules must not prove (they would need more than the graph says)
come back as None. The end-to-end tests fuse chains whose y width only this inference proves, without the
broadcast guard, and check the outputs against the original.
"""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import contrib_ops
from fusion._chains import ChainSpec, build_chain, chain_inputs
from fusion.rewrite import rewrite_model
from fusion.shapes import arith as _arith
from fusion.shapes.dims import ForwardShapes, forward_dims, resolve_shape_tensor

REPO = Path(__file__).resolve().parents[1]
LENGTHS = (1, 2, 3, 4, 5, 15, 16, 17, 31, 33)
INT_MAX = np.iinfo(np.int64).max


def _evaluate(dim, seq: int) -> int | None:
    if isinstance(dim, int):
        return dim
    if dim == "seq":
        return seq
    if isinstance(dim, _arith.QuasiAffine):
        a, b = dim.pieces[seq % dim.period]
        return a * (seq // dim.period) + b
    return None


def _model(nodes, inputs, output: str, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "case",
        inputs,
        [onnx.ValueInfoProto(name=output)],
        initializer=list(initializers),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _int(name: str, values) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.array(values, np.int64), name)


def _x(name: str = "x", *shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape or (1, "seq", 8)))


def _proven(model: onnx.ModelProto, output: str):
    graph = ir.from_proto(model).graph
    value = next(v for node in graph for v in node.outputs if v.name == output)
    return ForwardShapes(graph)(value)


def _feeds(model: onnx.ModelProto, seq: int) -> dict[str, np.ndarray]:
    feeds = {}
    for value in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else seq for d in value.type.tensor_type.shape.dim]
        kind = value.type.tensor_type.elem_type
        if kind == TensorProto.INT64:
            feeds[value.name] = np.zeros(dims, np.int64)  # valid indices for Gather / GatherND
        elif kind == TensorProto.BOOL:
            feeds[value.name] = np.ones(dims, bool)
        else:
            feeds[value.name] = np.ones(dims, np.float32)
    return feeds


def _shape_arithmetic_pad_to(multiple: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """pads = [0, 0, 0, 0, (multiple - seq % multiple) % multiple, 0], as dynamo's chunked scan computes it."""
    make = helper.make_node
    nodes = [
        make("Shape", ["x"], ["seq_1d"], start=1, end=2),
        make("Squeeze", ["seq_1d", "axis0"], ["seq_s"]),
        make("Mod", ["seq_s", "multiple"], ["r"]),
        make("Sub", ["multiple", "r"], ["p0"]),
        make("Mod", ["p0", "multiple"], ["p"]),
        make("Unsqueeze", ["p", "axis0"], ["p_1d"]),
        make("Concat", ["zeros4", "p_1d", "zero_1d"], ["pads"], axis=0),
    ]
    constants = [_int("axis0", [0]), _int("multiple", multiple), _int("zeros4", [0, 0, 0, 0]), _int("zero_1d", [0])]
    return nodes, constants


def _cases():
    make = helper.make_node
    pad_nodes, pad_constants = _shape_arithmetic_pad_to(4)
    return {
        "unsqueeze": ([make("Unsqueeze", ["x", "axes"], ["y"])], [_x()], [_int("axes", [0, -1])]),
        "squeeze": ([make("Squeeze", ["x", "axes"], ["y"])], [_x("x", 1, "seq", 1, 8)], [_int("axes", [2])]),
        "expand": (
            [
                make("Shape", ["x"], ["s"], start=1, end=2),
                make("Concat", ["one", "s", "eight"], ["shape"], axis=0),
                make("Expand", ["x", "shape"], ["y"]),
            ],
            [_x("x", 1, "seq", 1)],
            [_int("one", [1]), _int("eight", [8])],
        ),
        "split sizes": (
            [make("Split", ["x", "sizes"], ["a", "y"], axis=-1)],
            [_x()],
            [_int("sizes", [3, 5])],
        ),
        "split equal": ([make("Split", ["x"], ["y", "b"], axis=2, num_outputs=2)], [_x()], []),
        "concat": (
            [make("Concat", ["x", "t"], ["y"], axis=1)],
            [_x(), _x("t", 1, 4, 8)],
            [],
        ),
        "tile": ([make("Tile", ["x", "repeats"], ["y"])], [_x()], [_int("repeats", [1, 2, 3])]),
        # s is seq in x and 1 in w: ONNX Runtime broadcasts the label, the output has seq
        "einsum label of size 1 beside seq": (
            [make("Einsum", ["x", "w"], ["y"], equation="bsh,bsh->bsh")],
            [_x()],
            [onnx.numpy_helper.from_array(np.ones((1, 1, 8), np.float32), "w")],
        ),
        # torch's floor division as its exporter writes it: Div, less 1 where the remainder is not zero and the
        # signs differ (Sign, Equal, Not, Mod, Cast to bool, And, Cast back); here of the padded length by 4
        "floor division": (
            [
                *pad_nodes,
                make("Add", ["seq_s", "p"], ["padded"]),
                make("Div", ["padded", "multiple"], ["truncated"]),
                make("Sign", ["padded"], ["sign_a"]),
                make("Sign", ["multiple"], ["sign_b"]),
                make("Equal", ["sign_a", "sign_b"], ["same_sign"]),
                make("Not", ["same_sign"], ["signs_differ"]),
                make("Mod", ["padded", "multiple"], ["remainder"]),
                make("Cast", ["remainder"], ["inexact"], to=TensorProto.BOOL),
                make("And", ["signs_differ", "inexact"], ["adjust_bool"]),
                make("Cast", ["adjust_bool"], ["adjust"], to=TensorProto.INT64),
                make("Sub", ["truncated", "adjust"], ["chunks"]),
                make("Unsqueeze", ["chunks", "axis0"], ["chunks_1d"]),
                make("Concat", ["one", "chunks_1d", "eight"], ["shape"], axis=0),
                make("Expand", ["unit", "shape"], ["y"]),
            ],
            [_x()],
            [
                *pad_constants,
                _int("one", [1]),
                _int("eight", [8]),
                onnx.numpy_helper.from_array(np.ones((1, 1, 1), np.float32), "unit"),
            ],
        ),
        # a length cast to bool and back is 1, not the length
        "length cast to bool": (
            [
                make("Shape", ["x"], ["s"], start=1, end=2),
                make("Cast", ["s"], ["nonzero"], to=TensorProto.BOOL),
                make("Cast", ["nonzero"], ["flag"], to=TensorProto.INT64),
                make("Concat", ["flag", "s", "eight"], ["shape"], axis=0),
                make("Expand", ["unit", "shape"], ["y"]),
            ],
            [_x()],
            [_int("eight", [8]), onnx.numpy_helper.from_array(np.ones((1, 1, 1), np.float32), "unit")],
        ),
        "gemm": (
            [make("Gemm", ["x2", "b"], ["y"])],
            [_x("x2", "seq", 8)],
            [onnx.numpy_helper.from_array(np.ones((8, 5), np.float32), "b")],
        ),
        "gemm transposed": (
            [make("Gemm", ["x2", "b", "c"], ["y"], transA=1, transB=1)],
            [_x("x2", 8, "seq")],
            [
                onnx.numpy_helper.from_array(np.ones((5, 8), np.float32), "b"),
                onnx.numpy_helper.from_array(np.ones(5, np.float32), "c"),
            ],
        ),
        "topk": ([make("TopK", ["x", "k"], ["y", "indices"], axis=-1)], [_x()], [_int("k", [3])]),
        "topk indices": ([make("TopK", ["x", "k"], ["values", "y"], axis=2)], [_x()], [_int("k", [3])]),
        "gather": (
            [make("Gather", ["table", "ids"], ["y"])],
            [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "seq"])],
            [onnx.numpy_helper.from_array(np.ones((10, 8), np.float32), "table")],
        ),
        "matmul": (
            [make("MatMul", ["x", "w"], ["y"])],
            [_x()],
            [onnx.numpy_helper.from_array(np.ones((8, 12), np.float32), "w")],
        ),
        "einsum": (
            [make("Einsum", ["x", "w"], ["y"], equation="bsh,hk->bks")],
            [_x()],
            [onnx.numpy_helper.from_array(np.ones((8, 12), np.float32), "w")],
        ),
        "pad from shape arithmetic": (
            [*pad_nodes, make("Pad", ["x", "pads"], ["y"])],
            [_x()],
            pad_constants,
        ),
        "conv depthwise": (
            [make("Conv", ["xt", "w"], ["y"], group=8, pads=[3, 3])],
            [_x("xt", 1, 8, "seq")],
            [onnx.numpy_helper.from_array(np.ones((8, 1, 4), np.float32), "w")],
        ),
        "conv strided dilated": (
            [make("Conv", ["xt", "w"], ["y"], pads=[2, 2], strides=[3], dilations=[2])],
            [_x("xt", 1, 8, "seq")],
            [onnx.numpy_helper.from_array(np.ones((5, 8, 3), np.float32), "w")],
        ),
        "reduce keepdims": ([make("ReduceMean", ["x", "axes"], ["y"])], [_x()], [_int("axes", [-1])]),
        "reduce dropped": ([make("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], [_x()], [_int("axes", [0, 2])]),
        "slice all but last": (
            [make("Slice", ["x", "s0", "m1", "ax1"], ["y"])],
            [_x()],
            [_int("s0", [0]), _int("m1", [-1]), _int("ax1", [1])],
        ),
        "slice last one": (
            [make("Slice", ["x", "m1", "big", "ax1"], ["y"])],
            [_x()],
            [_int("m1", [-1]), _int("big", [INT_MAX]), _int("ax1", [1])],
        ),
        "slice from one": (
            [make("Slice", ["x", "one", "big", "ax1"], ["y"])],
            [_x()],
            [_int("one", [1]), _int("big", [INT_MAX]), _int("ax1", [1])],
        ),
        "slice static clamped": (
            [make("Slice", ["x", "two", "hundred", "ax2"], ["y"])],
            [_x()],
            [_int("two", [2]), _int("hundred", [100]), _int("ax2", [2])],
        ),
        "range": (
            [
                make("Shape", ["x"], ["s"], start=1, end=2),
                make("Squeeze", ["s", "axis0"], ["n"]),
                make("Range", ["zero", "n", "step"], ["y"]),
            ],
            [_x()],
            [_int("axis0", [0]), _int("zero", 0), _int("step", 4)],
        ),
        "gathernd": (
            [make("GatherND", ["x", "idx"], ["y"])],
            [_x(), helper.make_tensor_value_info("idx", TensorProto.INT64, [1, "seq", 2])],
            [],
        ),
        "sequence of sizes": (
            [
                make("SplitToSequence", ["x", "sizes"], ["parts"], axis=-1),
                make("SequenceAt", ["parts", "one"], ["y"]),
            ],
            [_x()],
            [_int("sizes", [3, 5]), _int("one", 1)],
        ),
        "sequence of parts": (
            [
                make("SplitToSequence", ["x", "three"], ["parts"], axis=-1),
                make("SequenceAt", ["parts", "last"], ["y"]),
            ],
            [_x()],
            [_int("three", 3), _int("last", -1)],
        ),
        "where": (
            [make("Where", ["c", "x", "zero"], ["y"])],
            [helper.make_tensor_value_info("c", TensorProto.BOOL, [1, "seq", 1]), _x()],
            [onnx.numpy_helper.from_array(np.zeros((), np.float32), "zero")],
        ),
        "constant of shape": (
            [make("Shape", ["x"], ["s"]), make("ConstantOfShape", ["s"], ["y"])],
            [_x()],
            [],
        ),
        "reshape with -1": (
            [make("Reshape", ["x", "target"], ["y"])],
            [_x()],
            [_int("target", [1, -1, 4, 2])],
        ),
        # torch's exporter: a length as a one-element tensor times [1], squeezed, as Range's limit
        "range to a one-element product": (
            [
                make("Shape", ["x"], ["s"], start=1, end=2),
                make("Mul", ["one", "s"], ["n_1d"]),
                make("Squeeze", ["n_1d"], ["n"]),
                make("Range", ["zero", "n", "step"], ["y"]),
            ],
            [_x()],
            [_int("one", [1]), _int("zero", 0), _int("step", 1)],
        ),
        # ... and an Expand's shape from Max(Sub(Shape, Shape), c) and Add(Shape, c), one-element tensors
        "expand to one-element arithmetic": (
            [
                make("Shape", ["x"], ["s"], start=1, end=2),
                make("Shape", ["x"], ["s_again"], start=1, end=2),
                make("Sub", ["s", "s_again"], ["nothing"]),
                make("Max", ["nothing", "two"], ["a"]),
                make("Add", ["s", "one"], ["b"]),
                make("Concat", ["a", "b", "eight"], ["shape"], axis=0),
                make("Expand", ["zero", "shape"], ["y"]),
            ],
            [_x()],
            [
                _int("two", [2]),
                _int("one", [1]),
                _int("eight", [8]),
                onnx.numpy_helper.from_array(np.zeros((), np.float32), "zero"),
            ],
        ),
    }


def _contrib_cases():
    """ONNX Runtime's contrib ops that its and onnxscript's fusions write: (node, output index of y)."""
    make = helper.make_node
    ms = {"domain": "com.microsoft"}
    return {
        "SimplifiedLayerNormalization": make("SimplifiedLayerNormalization", ["x", "gamma"], ["y"], axis=-1),
        "SkipSimplifiedLayerNormalization": make(
            "SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["y", "", "", "sum"], **ms
        ),
        "SkipSimplifiedLayerNormalization, its sum": make(
            "SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["out", "", "", "y"], **ms
        ),
        "SkipLayerNormalization": make("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["y"], **ms),
        "FastGelu": make("FastGelu", ["x"], ["y"], **ms),
        "BiasGelu": make("BiasGelu", ["x", "beta"], ["y"], **ms),
        "QuickGelu": make("QuickGelu", ["x"], ["y"], alpha=1.0, **ms),
        "Gelu": make("Gelu", ["x"], ["y"], **ms),
    }


def _cases_with_contrib_ops():
    cases = _cases()
    constants = [
        onnx.numpy_helper.from_array(np.ones(8, np.float32), "gamma"),
        onnx.numpy_helper.from_array(np.zeros(8, np.float32), "beta"),
    ]
    for name, node in _contrib_cases().items():
        inputs = [_x(), _x("skip")] if "skip" in node.input else [_x()]
        cases[name] = ([node], inputs, constants)
    return cases


@pytest.mark.parametrize("case", list(_cases_with_contrib_ops()))
def test_proven_dims_are_what_onnxruntime_produces(case: str) -> None:
    nodes, inputs, constants = _cases_with_contrib_ops()[case]
    model = _model(nodes, inputs, "y", constants)
    if nodes[0].domain == "com.microsoft":
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    proven = _proven(model, "y")
    assert proven is not None, f"{case}: not proven"
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in LENGTHS:
        got = session.run(["y"], _feeds(model, seq))[0].shape
        assert [_evaluate(d, seq) for d in proven] == list(got), f"{case}, seq = {seq}: {proven} vs {got}"


def _unproven_cases():
    make = helper.make_node
    return {
        "einsum with an ellipsis": (
            [make("Einsum", ["x", "w"], ["y"], equation="...h,hk->...k")],
            [_x()],
            [onnx.numpy_helper.from_array(np.ones((8, 12), np.float32), "w")],
        ),
        "einsum label of two sizes": (  # s is seq in x and 5 in w: equal only where the node runs, not proven
            [make("Einsum", ["x", "w"], ["y"], equation="bsh,bsh->bsh")],
            [_x()],
            [onnx.numpy_helper.from_array(np.ones((1, 5, 8), np.float32), "w")],
        ),
        "slice with step 2": (
            [make("Slice", ["x", "s0", "big", "ax1", "two"], ["y"])],
            [_x()],
            [_int("s0", [0]), _int("big", [INT_MAX]), _int("ax1", [1]), _int("two", [2])],
        ),
        "slice that may start past the end": (  # seq - 5 is negative for short sequences: ONNX gives 0
            [make("Slice", ["x", "five", "big", "ax1"], ["y"])],
            [_x()],
            [_int("five", [5]), _int("big", [INT_MAX]), _int("ax1", [1])],
        ),
        "squeeze of every 1 with a symbolic dim": ([make("Squeeze", ["x"], ["y"])], [_x()], []),
        "range of a run-time step": (
            [make("Range", ["zero", "n", "step"], ["y"])],
            [
                helper.make_tensor_value_info("n", TensorProto.INT64, []),
                helper.make_tensor_value_info("step", TensorProto.INT64, []),
            ],
            [_int("zero", 0)],
        ),
        "reduce over run-time axes": (
            [make("ReduceMean", ["x", "axes"], ["y"])],
            [_x(), helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
            [],
        ),
        "conv with auto_pad": (
            [make("Conv", ["xt", "w"], ["y"], auto_pad="SAME_UPPER")],
            [_x("xt", 1, 8, "seq")],
            [onnx.numpy_helper.from_array(np.ones((8, 8, 4), np.float32), "w")],
        ),
        "an op without a rule": ([make("NonZero", ["x"], ["y"])], [_x()], []),
    }


@pytest.mark.parametrize("case", list(_unproven_cases()))
def test_what_the_rules_do_not_cover_is_not_proven(case: str) -> None:
    """No dims, or (an Einsum label two operands disagree on) that dim unknown."""
    nodes, inputs, constants = _unproven_cases()[case]
    proven = _proven(_model(nodes, inputs, "y", constants), "y")
    assert proven is None or proven[1] is None, proven


def _group_query_attention(packed: bool, width: int) -> onnx.ModelProto:
    """ORT's GroupQueryAttention on a prompt (no past): 4 heads, 2 key/value heads of 8, query [1, seq, width]
    with key and value packed into it, or beside it ([1, seq, 16] each)."""
    qkv = ["q", "", ""] if packed else ["q", "k", "v"]
    node = helper.make_node(
        "GroupQueryAttention",
        [*qkv, "", "", "seqlens_k", "total"],
        ["y"],
        domain="com.microsoft",
        num_heads=4,
        kv_num_heads=2,
    )
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, "seq", width])]
    if not packed:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "seq", 16]) for n in ("k", "v")]
    inputs += [
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
    ]
    model = _model([node], inputs, "y")
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "key-and-value"])
def test_group_query_attention_output_dims_are_what_onnxruntime_produces(packed: bool) -> None:
    """Zamba2's transformers-ort export runs its attention as ORT's GroupQueryAttention: its output's dims
    (num_heads * head_size wide) must be proven for the chains after it to be."""
    model = _group_query_attention(packed, 64 if packed else 32)
    proven = _proven(model, "y")
    assert proven is not None
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in LENGTHS:
        feeds = {
            name: np.ones((1, seq, dim), np.float32)
            for name, dim in (("q", 64 if packed else 32), ("k", 16), ("v", 16))
        }
        if packed:
            del feeds["k"], feeds["v"]
        feeds |= {"seqlens_k": np.array([seq - 1], np.int32), "total": np.array(seq, np.int32)}
        got = session.run(["y"], feeds)[0].shape
        assert [_evaluate(d, seq) for d in proven] == list(got), f"seq = {seq}: {proven} vs {got}"


def test_group_query_attention_of_a_width_the_heads_do_not_divide_is_not_proven() -> None:
    assert _proven(_group_query_attention(True, 60), "y") is None


def _multi_head_attention(bnsh: bool) -> onnx.ModelProto:
    """ORT's MultiHeadAttention as transformers-ort's Zamba2 decode uses it: query [1, seq, 32], 2 heads of 16;
    key and value [1, kv, 32], or in BNSH [1, 2, kv, 16] with a symbolic head size (as that graph's cache)."""
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"], domain="com.microsoft", num_heads=2)
    kv_shape = [1, 2, "kv", "head"] if bnsh else [1, "kv", 32]
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, "seq", 32])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in ("k", "v")]
    model = _model([node], inputs, "y")
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


@pytest.mark.parametrize("bnsh", [False, True], ids=["BSH", "BNSH"])
def test_multi_head_attention_output_dims_are_what_onnxruntime_produces(bnsh: bool) -> None:
    """Zamba2's transformers-ort decode export runs its attention as ORT's MultiHeadAttention: the output's rank
    and leading dims (and its width where the value's head size is a number) are proven, as ORT produces them."""
    model = _multi_head_attention(bnsh)
    proven = _proven(model, "y")
    assert proven is not None and len(proven) == 3
    assert proven[2] is None if bnsh else proven[2] == 32  # BNSH: the cache's head size is symbolic
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in LENGTHS:
        kv = seq + 3
        kv_shape = (1, 2, kv, 16) if bnsh else (1, kv, 32)
        feeds = {"q": np.ones((1, seq, 32), np.float32)}
        feeds |= {n: np.ones(kv_shape, np.float32) for n in ("k", "v")}
        got = session.run(["y"], feeds)[0].shape
        expected = [_evaluate(d, seq) if d is not None else got[i] for i, d in enumerate(proven)]
        assert expected == list(got), f"seq = {seq}: {proven} vs {got}"


def test_rotary_embedding_output_dims_are_its_input_dims() -> None:
    node = helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain="com.microsoft", interleaved=0)
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", 32]),
        helper.make_tensor_value_info("pos", TensorProto.INT64, [1, "seq"]),
    ]
    tables = [onnx.numpy_helper.from_array(np.ones((64, 8), np.float32), name) for name in ("cos", "sin")]
    model = _model([node], inputs, "y", tables)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    proven = _proven(model, "y")
    assert proven is not None
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in LENGTHS:
        feeds = {"x": np.ones((1, seq, 32), np.float32), "pos": np.arange(seq, dtype=np.int64)[None]}
        got = session.run(["y"], feeds)[0].shape
        assert [_evaluate(d, seq) for d in proven] == list(got), f"seq = {seq}: {proven} vs {got}"


def test_arithmetic_that_broadcasts_is_not_one_shape_element() -> None:
    """[seq] + [1, 2] has two elements: an Expand to Concat([1], that) is rank 3, so no dims are proven (a
    one-element result claimed here would make it rank 2)."""
    make = helper.make_node
    nodes = [
        make("Shape", ["x"], ["s"], start=1, end=2),
        make("Add", ["s", "one_two"], ["b"]),
        make("Concat", ["one", "b"], ["shape"], axis=0),
        make("Expand", ["zero", "shape"], ["y"]),
    ]
    constants = [
        _int("one", [1]),
        _int("one_two", [1, 2]),
        onnx.numpy_helper.from_array(np.zeros((), np.float32), "zero"),
    ]
    assert _proven(_model(nodes, [_x()], "y", constants), "y") is None


def test_a_shape_of_an_intermediate_uses_its_proven_dims_not_its_declared_ones() -> None:
    """t = Concat(x, x) on the sequence axis is [1, 2 seq, 8]; its value_info says [1, seq, 8]. A Reshape to
    [1, Shape(t)[1], -1] is then [1, 2 seq, 8]: the proof reads t's dims from the graph, not the annotation."""
    make = helper.make_node
    nodes = [
        make("Concat", ["x", "x"], ["t"], axis=1),
        make("Shape", ["t"], ["s"], start=1, end=2),
        make("Concat", ["one", "s", "minus_one"], ["target"], axis=0),
        make("Reshape", ["t", "target"], ["y"]),
    ]
    model = _model(nodes, [_x()], "y", [_int("one", [1]), _int("minus_one", [-1])])
    model.graph.value_info.append(helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, "seq", 8]))
    proven = _proven(model, "y")
    assert proven is not None
    assert [_evaluate(d, 5) for d in proven] == [1, 10, 8]
    # forward_dims (the walk back from one value) reads t the same way
    y = next(v for node in ir.from_proto(model).graph for v in node.outputs if v.name == "y")
    walked = forward_dims(y)
    assert walked is not None
    assert [_evaluate(d, 5) for d in walked] == [1, 10, 8]


def _chunked_scan_chain(chunk: int = 4) -> onnx.ModelProto:
    """A gated norm chain whose y is x [1, seq, 64] padded to a multiple of ``chunk``, cut into chunks, passed
    through an Einsum, put back and sliced to seq, then Reshaped to [1, seq, -1]: as dynamo writes a Mamba-2
    scan. y's declared width is an expression (as dynamo records it); only forward inference proves it is 64."""
    model = build_chain(ChainSpec(leading=(1, "seq"), shape_as="dynamic"))
    graph = model.graph
    next(v for v in graph.input if v.name == "y").name = "x"
    make = helper.make_node
    pad_nodes, pad_constants = _shape_arithmetic_pad_to(chunk)
    scan = [
        *pad_nodes,
        make("Pad", ["x", "pads"], ["padded"]),
        make("Reshape", ["padded", "chunked_shape"], ["chunked"]),
        make("Einsum", ["chunked", "mix"], ["mixed"], equation="bclh,lm->bcmh"),
        make("Reshape", ["mixed", "flat_shape"], ["flat"]),
        make("Slice", ["flat", "start0", "seq_1d", "axis1"], ["kept"]),
        make("Shape", ["x"], ["seq_again"], start=1, end=2),
        make("Concat", ["one_1d", "seq_again", "minus_one"], ["y_shape"], axis=0),
        make("Reshape", ["kept", "y_shape"], ["y"]),
    ]
    graph.initializer.extend(pad_constants)
    graph.initializer.extend(
        [
            _int("chunked_shape", [1, -1, chunk, 64]),
            onnx.numpy_helper.from_array(np.eye(chunk, dtype=np.float32), "mix"),
            _int("flat_shape", [1, -1, 64]),
            _int("start0", [0]),
            _int("axis1", [1]),
            _int("one_1d", [1]),
            _int("minus_one", [-1]),
        ]
    )
    for node in reversed(scan):
        graph.node.insert(0, node)
    del graph.value_info[:]
    model = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    return model


def test_a_width_only_forward_inference_proves_fuses_without_the_guard() -> None:
    model = _chunked_scan_chain()
    graph = ir.from_proto(model).graph
    y = next(v for node in graph for v in node.outputs if v.name == "y")
    assert not isinstance(y.shape[-1], int)  # declared: a symbol; the width is 64 only by the graph's proof
    assert forward_dims(y) == [1, "seq", 64]
    fused, report = rewrite_model(model)
    assert report.fused == 1, report.summary()
    assert not [n for n in fused.graph.node if n.op_type == "Expand"]  # no broadcast guard
    for seq in (1, 4, 7, 9):
        feeds = chain_inputs(ChainSpec(leading=(1, seq)))
        feeds["x"] = feeds.pop("y")
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        for use_library in (True, False):
            got = contrib_ops.session(fused, use_library=use_library).run(None, feeds)[0]
            assert got.shape == want.shape
            assert np.max(np.abs(got - want)) <= 1e-5 * max(float(np.max(np.abs(want))), 1.0)


@pytest.mark.parametrize(
    "path",
    sorted(p for p in glob.glob(str(REPO / "tests/fixtures/models/*-dynamo-*prefill.onnx"))),
    ids=lambda p: Path(p).stem,
)
def test_dynamo_dynamic_prefill_exports_fuse_without_the_guard(path: str) -> None:
    """The fixtures' dynamic-sequence dynamo exports (optimized, not optimized, opset 23): every chain's widths
    are proven from the graph, so the fused model has no Expand that the original did not have (the fused scans take
    theirs with them: fewer remain)."""
    model = onnx.load(path)
    fused, report = rewrite_model(model)
    assert report.fused >= 2, report.summary()
    expands = lambda m: {n.output[0] for n in m.graph.node if n.op_type == "Expand"}  # noqa: E731
    assert expands(fused) <= expands(model)


def test_a_number_beside_an_unproven_dim_broadcasts_to_the_number() -> None:
    """Add(x [1, k, 8], c [1, 3, 8]) runs only where k is 3 or 1, and then gives [1, 3, 8]; at any other k the
    node fails. So the output's dims are proven without knowing k."""
    model = _model(
        [helper.make_node("Add", ["x", "c"], ["y"])],
        [_x("x", 1, "k", 8)],
        "y",
        [onnx.numpy_helper.from_array(np.ones((1, 3, 8), np.float32), "c")],
    )
    assert _proven(model, "y") == [1, 3, 8]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for k in (1, 3):
        assert session.run(None, {"x": np.ones((1, k, 8), np.float32)})[0].shape == (1, 3, 8)
    with pytest.raises(Exception, match="(?i)broadcast|shape"):
        session.run(None, {"x": np.ones((1, 2, 8), np.float32)})


# --- an element no expression follows (issue 25: whole-model dynamo prefill traced at a multiple) -------


def _padded_count_nodes(source: str, out: str) -> list[onnx.NodeProto]:
    """out = (32 * ceil(s / 8)) // s from s = Shape(x)[1], torch's group count of a padded scan: a scalar."""
    return [
        helper.make_node("Shape", ["x"], ["s1"], start=1, end=2),
        helper.make_node("Squeeze", ["s1"], ["s"]),
        helper.make_node("Mod", ["s", "c8"], ["r"]),
        helper.make_node("Sub", ["c8", "r"], ["pad0"]),
        helper.make_node("Mod", ["pad0", "c8"], ["pad"]),
        helper.make_node("Add", ["s", "pad"], ["padded"]),
        helper.make_node("Div", ["padded", "c8"], ["chunks"]),
        helper.make_node("Mul", ["chunks", "c32"], ["total"]),
        helper.make_node("Div", ["total", source], [out]),
    ]


def test_an_element_no_expression_follows_keeps_the_targets_length() -> None:
    """Reshape(x, [1, s, (32 * ceil(s / 8)) // s, 2]) on x [1, s, 8]: the third dim is unknown, the others are
    the target's, and the element (a scalar the forward inference proves to be []) keeps the length."""
    nodes = [
        *_padded_count_nodes("s", "count"),
        helper.make_node("Reshape", ["count", "flat"], ["count_1d"]),
        helper.make_node("Concat", ["one", "s1", "count_1d", "two"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [_int("c8", 8), _int("c32", 32), _int("flat", [-1]), _int("one", [1]), _int("two", [2])]
    model = _model(nodes, [_x("x", 1, "seq", 8)], "y", inits)
    assert _proven(model, "y") == [1, "seq", None, 2]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in (8, 16):  # a multiple of 8: the element is 4, and the Reshape runs
        assert session.run(None, {"x": np.zeros((1, seq, 8), np.float32)})[0].shape == (1, seq, 4, 2)
    with pytest.raises(Exception, match="(?i)reshape"):  # elsewhere it is not 4: the node fails
        session.run(None, {"x": np.zeros((1, 5, 8), np.float32)})


def test_an_element_of_unproven_size_is_not_one_element() -> None:
    """The same element from an Unsqueeze of x's whole shape (three elements once broadcast): Reshape(·, [-1])
    is then three elements, and the target's length is not proven."""
    nodes = [
        *_padded_count_nodes("s", "count"),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Unsqueeze", ["shape", "axis0"], ["shape_2d"]),
        helper.make_node("Add", ["count", "shape_2d"], ["wide"]),
        helper.make_node("Reshape", ["wide", "flat"], ["wide_1d"]),
        helper.make_node("Concat", ["one", "wide_1d"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [_int("c8", 8), _int("c32", 32), _int("flat", [-1]), _int("one", [1]), _int("axis0", [0])]
    model = _model(nodes, [_x("x", 1, "seq", 8)], "y", inits)
    assert _proven(model, "y") is None


def test_an_unsqueezed_vector_is_not_one_element() -> None:
    """Unsqueeze of a three-element shape is a 1 x 3 tensor, not a one-element shape: a row Gathered from it and
    flattened is three elements, so the target below is [1, 1, seq, 8] (what ONNX Runtime makes), never a
    two-element shape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Unsqueeze", ["shape", "axis0"], ["shape_2d"]),
        helper.make_node("Gather", ["shape_2d", "first"], ["row"], axis=0),
        helper.make_node("Reshape", ["row", "flat"], ["row_1d"]),
        helper.make_node("Concat", ["one", "row_1d"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [_int("flat", [-1]), _int("one", [1]), _int("axis0", [0]), _int("first", [0])]
    model = _model(nodes, [_x("x", 1, "seq", 8)], "y", inits)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": np.zeros((1, 5, 8), np.float32)})[0].shape == (1, 1, 5, 8)
    assert _proven(model, "y") in (None, [1, 1, "seq", 8])
    graph = ir.from_proto(model).graph
    aliases = ForwardShapes(graph).aliases({})
    for name in ("shape_2d", "row"):  # 1 x 3 tensors: no one-element claim
        value = next(v for node in graph for v in node.outputs if v.name == name)
        assert resolve_shape_tensor(value, aliases) is None, name


def _quantized_matmul_model(fmt: str) -> onnx.ModelProto:
    """x [1, seq, 64] @ w (64 x 48) through ORT's quantizer: ``MatMulNBits`` (QOperator) or DequantizeLinear +
    MatMul (QDQ), 4 bits, block 32."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    weight = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32), "w")
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    model = _model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", 64])], "y", [weight])
    model.opset_import[0].version = 21
    quantizer = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True, quant_format=getattr(QuantFormat, fmt))
    quantizer.process()
    return quantizer.model.model


@pytest.mark.parametrize("fmt", ["QOperator", "QDQ"])
def test_quantized_matmul_output_dims_are_what_onnxruntime_produces(fmt: str) -> None:
    """int4-quantized projections (what onnxruntime-genai deploys): their output dims are proven from the op's
    attributes (MatMulNBits' N) or the dequantized weight's, as ORT produces them."""
    model = _quantized_matmul_model(fmt)
    assert ("MatMulNBits" if fmt == "QOperator" else "DequantizeLinear") in {n.op_type for n in model.graph.node}
    proven = _proven(model, "y")
    assert proven is not None and proven[0] == 1 and proven[2] == 48, proven
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in LENGTHS:
        got = session.run(["y"], {"x": np.ones((1, seq, 64), np.float32)})[0].shape
        assert [_evaluate(d, seq) for d in proven] == list(got), f"seq = {seq}: {proven} vs {got}"


def test_matmul_nbits_of_another_width_than_k_is_not_proven() -> None:
    model = _quantized_matmul_model("QOperator")
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 32  # the kernel rejects an A whose width is not K
    assert _proven(model, "y") is None


@pytest.mark.parametrize(("trans_a", "trans_b"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_fused_matmul_output_dims_are_what_onnxruntime_produces(trans_a: int, trans_b: int) -> None:
    a_shape = [2, 8, "seq"] if trans_a else [2, "seq", 8]
    b = onnx.numpy_helper.from_array(np.ones((6, 8) if trans_b else (8, 6), np.float32), "b")
    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft", transA=trans_a, transB=trans_b)
    model = _model([node], [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape)], "y", [b])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    proven = _proven(model, "y")
    assert proven is not None
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in LENGTHS:
        a = np.ones([seq if d == "seq" else d for d in a_shape], np.float32)
        got = session.run(["y"], {"a": a})[0].shape
        assert [_evaluate(d, seq) for d in proven] == list(got), f"seq = {seq}: {proven} vs {got}"


def test_gather_block_quantized_unpacks_a_4_bit_table() -> None:
    """A quantized embedding: [vocab, width / 2] uint8 bytes of two 4-bit values gather to [.., width]."""
    table = onnx.numpy_helper.from_array(np.zeros((10, 16), np.uint8), "table")
    scales = onnx.numpy_helper.from_array(np.ones((10, 1), np.float32), "scales")
    node = helper.make_node(
        "GatherBlockQuantized",
        ["table", "ids", "scales"],
        ["y"],
        domain="com.microsoft",
        gather_axis=0,
        quantize_axis=1,
        block_size=32,
        bits=4,
    )
    model = _model([node], [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "seq"])], "y", [table, scales])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    proven = _proven(model, "y")
    assert proven is not None and proven[-1] == 32, proven
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in LENGTHS:
        got = session.run(["y"], {"ids": np.zeros((1, seq), np.int64)})[0].shape
        assert [_evaluate(d, seq) for d in proven] == list(got), f"seq = {seq}: {proven} vs {got}"


def test_a_symbol_a_concat_fixes_to_a_number_is_that_number_everywhere() -> None:
    """A decode step's cache batch (its own symbol) beside the step's batch of 1 in the conv's Concat: the
    Concat runs only where they are equal, so the cache's batch is 1 in the whole graph, also before the Concat
    (a Shape of the cache read by an earlier node) and through a second cache whose symbol only a later node
    fixes against a value the first binding proves."""
    nodes = [
        helper.make_node("Shape", ["cache"], ["cache_shape"]),  # read before the Concat fixes its batch
        helper.make_node("Concat", ["cache", "x"], ["window"], axis=-1),
        helper.make_node("Reshape", ["window", "flat"], ["rows"]),  # [-1, 8]: the batch of 1 pins the -1
        helper.make_node("Concat", ["cache2", "rows3"], ["window2"], axis=-1),
        helper.make_node("Expand", ["x", "cache_shape"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("cache", TensorProto.FLOAT, ["b1", 8, "k"]),
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 1]),
        helper.make_tensor_value_info("cache2", TensorProto.FLOAT, ["b2", "c2", 3]),
    ]
    nodes.insert(3, helper.make_node("Unsqueeze", ["rows", "zero"], ["rows3"]))
    model = _model(nodes, inputs, "y", [_int("flat", [-1, 8]), _int("zero", [0])])
    shapes = ForwardShapes(ir.from_proto(model).graph)
    graph = shapes._graph
    values = {v.name: v for node in graph for v in node.outputs} | {v.name: v for v in graph.inputs}
    assert shapes(values["y"])[:2] == [1, 8]
    assert shapes(values["cache"])[:2] == [1, 8]
    # window2: Concat([b2, c2, 3], [1, k + 1, 8]) on the last axis: b2 = 1 and c2 = k + 1 is not a number
    assert shapes(values["cache2"])[0] == 1
    assert shapes(values["cache2"])[1] == "c2"
