"""The CUDA kernels of ai.mambafuse::DecodeMatMul and DecodeMatMulNBits against fusion/reference/decode_matmul.py
(docs/decode_matmul.md) at its accuracy budget: every type, M = 1..8 (the GEMVs) and 9, 64 (cuBLAS, after the int4
weight is dequantized), K off the block size and off 8, N off the 16-byte vector width, with and without zero
points, block sizes 16 to 128, A of rank 1, 2 and 3, Nemotron-H-8B's projection shapes; int4 against ONNX Runtime's
own CPU MatMulNBits (the layout's ground truth); a captured CUDA graph equal to the uncaptured run bit for bit; empty
and K = 0 products; bad inputs.

Every kernel rounds the int4 weight to T before the product (the budget's u_T on W); the dense kernel does not
round (B is already T). Needs onnxruntime with the CUDA execution provider, a GPU, and the library built with
-DMAMBAFUSE_CUDA=ON ($MAMBAFUSE_LIBRARY). Every session forbids CPU fallback, so a library without the CUDA kernels
fails instead of running something else.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from benchmarks.bench_cuda_gemv import SHAPES
from fusion.reference.decode_matmul import blocks_of, check_within_budget, dequantize
from tests._cuda import CUDA, cuda_problem, cuda_session, feeds_of, with_supported_ir
from tests._decode_step import BFLOAT16, DOMAIN, DTYPE_IDS, DTYPES, FLOAT, FLOAT16, IR_VERSION
from tests._int4 import activations, int4_weight

ort = pytest.importorskip("onnxruntime")
_problem = cuda_problem(ort)
pytestmark = pytest.mark.skipif(_problem is not None, reason=_problem or "")

ROWS = (1, 2, 3, 4, 7, 8, 9, 64)
#: Nemotron-H-8B's projections (K, N) but the lm_head (its float64 reference alone is 4 GB).
PROJECTIONS = {name: shape for name, shape in SHAPES.items() if name != "lm_head"}


def one_node_model(op_type: str, inputs, outputs, *, dynamic: bool = False, **attrs: object) -> onnx.ModelProto:
    """A model of one ``op_type`` node (tests/_decode_step.py's, with integer inputs too): bfloat16 values enter as
    float32 through a Cast and leave through one; None is an empty optional input."""
    nodes, graph_inputs, node_inputs = [], [], []
    for name, value in inputs:
        if value is None:
            node_inputs.append("")
            continue
        shape = [None] * value.ndim if dynamic else list(value.shape)
        if value.dtype == BFLOAT16:
            graph_inputs.append(oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape))
            nodes.append(oh.make_node("Cast", [name], [f"{name}_bf16"], to=onnx.TensorProto.BFLOAT16))
            node_inputs.append(f"{name}_bf16")
        else:
            graph_inputs.append(oh.make_tensor_value_info(name, oh.np_dtype_to_tensor_dtype(value.dtype), shape))
            node_inputs.append(name)
    node_outputs, graph_outputs = [], []
    for name, dtype in outputs:
        if np.dtype(dtype) == BFLOAT16:
            node_outputs.append(f"{name}_bf16")
            nodes.append(oh.make_node("Cast", [f"{name}_bf16"], [name], to=onnx.TensorProto.FLOAT))
            elem = onnx.TensorProto.FLOAT
        else:
            node_outputs.append(name)
            elem = oh.np_dtype_to_tensor_dtype(np.dtype(dtype))
        graph_outputs.append(oh.make_tensor_value_info(name, elem, None))
    nodes.insert(0, oh.make_node(op_type, node_inputs, node_outputs, domain=DOMAIN, **attrs))
    graph = oh.make_graph(nodes, op_type, graph_inputs, graph_outputs)
    return oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(DOMAIN, 1)], ir_version=IR_VERSION
    )


def run_dense(a: np.ndarray, b: np.ndarray, **provider_options: str) -> np.ndarray:
    model = one_node_model("DecodeMatMul", [("A", a), ("B", b)], [("Y", a.dtype)])
    out = cuda_session(model, **provider_options).run(None, feeds_of([("A", a), ("B", b)]))[0]
    return out.astype(a.dtype)


def nbits_model(a, b, scales, zp, *, k: int, n: int, block_size: int) -> onnx.ModelProto:
    inputs = [("A", a), ("B", b), ("scales", scales), ("zero_points", zp)]
    return one_node_model(
        "DecodeMatMulNBits", inputs, [("Y", a.dtype)], K=k, N=n, bits=4, block_size=block_size, accuracy_level=0
    )


def run_nbits(a, b, scales, zp, *, k: int, n: int, block_size: int) -> np.ndarray:
    model = nbits_model(a, b, scales, zp, k=k, n=n, block_size=block_size)
    feeds = feeds_of([("A", a), ("B", b), ("scales", scales), ("zero_points", zp)])
    return cuda_session(model).run(None, feeds)[0].astype(a.dtype)


def assert_within_budget(y: np.ndarray, a: np.ndarray, w: np.ndarray, label: str) -> None:
    outside, detail = check_within_budget(y, a, w)
    assert outside == 0, f"{label}: {outside} of {y.size} outputs outside the budget; {detail}"


def check_nbits(rng: np.random.Generator, t, m: int, k: int, n: int, block_size: int, zero_points: bool, label=""):
    """A (M × K) and an int4 weight drawn from rng, DecodeMatMulNBits run on them, its Y within the budget of the
    weight it dequantizes to."""
    a = activations(rng, (m, k), t)
    b, scales, zp = int4_weight(rng, k, n, block_size, t, zero_points)
    y = run_nbits(a, b, scales, zp, k=k, n=n, block_size=block_size)
    w = dequantize(b, scales, zp, k=k, n=n, block_size=block_size)
    case = f"T={DTYPE_IDS[t]} M={m} K={k} N={n} bs={block_size} zp={zero_points}"
    assert_within_budget(y, a, w, f"{label} {case}".strip())


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("k", "n"), [(100, 37), (4100, 256), (512, 4104), (8, 1)])
def test_dense(t, m, k, n):
    """K off 8 and off the split's chunks, N off the 16-byte vector (the scalar-load kernel) and on it."""
    rng = np.random.default_rng([DTYPES.index(t), m, k, n])
    a = activations(rng, (m, k), t)
    b = activations(rng, (k, n), t)
    y = run_dense(a, b)
    assert y.shape == (m, n)
    assert_within_budget(y, a, b.astype(np.float64), f"T={DTYPE_IDS[t]} M={m} K={k} N={n}")


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(
    ("k", "n", "block_size", "zero_points"),
    [
        (100, 40, 32, True),
        (4100, 72, 128, False),
        (4112, 33, 16, True),
        (256, 16, 64, False),
        (4096, 250, 32, True),
        (256, 40000, 32, True),
        (512, 70001, 128, False),
    ],
    ids=["K100-bs32-zp", "K4100-bs128", "K4112-bs16-zp", "K256-bs64", "K4096-bs32-zp", "N40000", "N70001"],
)
def test_nbits(t, m, k, n, block_size, zero_points):
    """K off the block size (a padded last block), an odd number of 16-wide blocks (8-byte rows, the unaligned load
    path), N off the 16 columns of a block, with and without zero points; wide N (2 and 1 warps per 16 columns)."""
    check_nbits(np.random.default_rng([DTYPES.index(t), m, k, n, block_size]), t, m, k, n, block_size, zero_points)


#: The register-load int4 GEMV's launch knobs (docs/decode_matmul.md, Kernels), with that kernel forced where the
#: bulk-copy one would run: warps a group of 16 columns splits K over, the steps' order (contiguous ranges or
#: interleaved) and the L2 prefetch distance of contiguous ranges.
LAUNCH_POLICIES = [
    {
        "MAMBAFUSE_NBITS_KERNEL": "mma",
        "MAMBAFUSE_NBITS_GROUP_WARPS": str(warps),
        "MAMBAFUSE_NBITS_ORDER": order,
        "MAMBAFUSE_NBITS_PREFETCH": str(ahead),
    }
    for warps in (1, 2, 4, 8)
    for order, ahead in (("interleaved", 0), ("contiguous", 0), ("contiguous", 16), ("contiguous", 3))
]


@pytest.mark.parametrize("policy", LAUNCH_POLICIES, ids=lambda p: "-".join(p.values()))
@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize(
    ("k", "n", "block_size", "zero_points"),
    [(4100, 72, 128, False), (4112, 33, 16, True), (1000, 40, 32, True), (8192, 48, 64, False)],
    ids=["K4100-bs128", "K4112-bs16-zp", "K1000-bs32-zp", "K8192-bs64"],
)
def test_nbits_launch_policies(monkeypatch, policy, t, m, k, n, block_size, zero_points):
    """Every split of K, both step orders and prefetch distances (one that is not a multiple of the batch) give
    results within the budget: ranges that end mid-batch, warps with no steps, rows past N, the padded last block."""
    for key, value in policy.items():
        monkeypatch.setenv(key, value)
    rng = np.random.default_rng([DTYPES.index(t), m, k, n, block_size])
    check_nbits(rng, t, m, k, n, block_size, zero_points, str(policy))


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize(
    ("k", "n", "block_size", "zero_points"),
    [
        (1000, 40, 32, True),
        (4096, 33, 16, True),
        (4000, 1000, 128, True),
        (8192, 48, 64, False),
        (12288, 1040, 32, False),
        (256, 40000, 32, False),
        (128, 7, 16, True),
        (4096, 18560, 32, False),
        (1024, 9000, 64, True),
        (21504, 144, 32, True),
        (4096, 6144, 128, True),
    ],
    ids=[
        "K1000-pad",
        "K4096-bs16-zp",
        "K4000-bs128-zp",
        "K8192-bs64",
        "K12288-tiles",
        "N40000-groups",
        "N7",
        "in-proj-groups",
        "N9000-groups-zp",
        "K21504-tiles-zp",
        "qkv-lanes-zp",
    ],
)
def test_nbits_bulk_kernel(monkeypatch, t, m, k, n, block_size, zero_points):
    """The bulk-copy kernel (SM 90, a multiple of 8 blocks a row): K padded to its blocks, block sizes 16 to 128 with
    and without zero points, several tiles a group (a partial last one), many groups a block, groups past N, and a
    block's two lanes with one group more on one (N = 33, 144, 6144) or none on one (N = 7); the register-load
    kernel on the same input gives a result within the same budget."""
    seed = [DTYPES.index(t), m, k, n, block_size, 1]
    check_nbits(np.random.default_rng(seed), t, m, k, n, block_size, zero_points, "bulk")
    monkeypatch.setenv("MAMBAFUSE_NBITS_KERNEL", "mma")
    check_nbits(np.random.default_rng(seed), t, m, k, n, block_size, zero_points, "mma")


@pytest.mark.parametrize("shape", PROJECTIONS)
@pytest.mark.parametrize("m", [1, 8])
def test_projection_shapes(shape, m):
    """float16 at Nemotron-H-8B's widths: dense, and int4 with block sizes 32 (zero points) and 128 (none)."""
    k, n = PROJECTIONS[shape]
    rng = np.random.default_rng([k, n, m])
    a = activations(rng, (m, k), FLOAT16)
    b = (activations(rng, (k, n), np.float32) * 0.02).astype(FLOAT16)
    assert_within_budget(run_dense(a, b), a, b.astype(np.float64), f"dense {shape} M={m}")
    for block_size, zero_points in ((32, True), (128, False)):
        qb, scales, zp = int4_weight(rng, k, n, block_size, FLOAT16, zero_points)
        y = run_nbits(a, qb, scales, zp, k=k, n=n, block_size=block_size)
        w = dequantize(qb, scales, zp, k=k, n=n, block_size=block_size)
        assert_within_budget(y, a, w, f"int4 {shape} M={m} bs={block_size}")


@pytest.mark.parametrize("shape", [(100,), (2, 3, 100), (1, 1, 100)], ids=["rank1", "rank3", "rank3-one"])
@pytest.mark.parametrize("t", [FLOAT, FLOAT16], ids=DTYPE_IDS.get)
def test_rank_of_a(shape, t):
    """Y keeps A's leading dims: (K,) -> (N,), (2, 3, K) -> (2, 3, N) (M = 6)."""
    rng = np.random.default_rng(len(shape))
    a = activations(rng, shape, t)
    b = activations(rng, (100, 48), t)
    y = run_dense(a, b)
    assert y.shape == (*shape[:-1], 48)
    assert_within_budget(y, a, b.astype(np.float64), f"dense A{shape}")
    qb, scales, zp = int4_weight(rng, 100, 48, 32, t, True)
    y = run_nbits(a, qb, scales, zp, k=100, n=48, block_size=32)
    assert y.shape == (*shape[:-1], 48)
    assert_within_budget(y, a, dequantize(qb, scales, zp, k=100, n=48, block_size=32), f"int4 A{shape}")


def ort_cpu_matmul_nbits(a, b, scales, zp, *, k: int, n: int, block_size: int) -> np.ndarray:
    """ONNX Runtime's own com.microsoft::MatMulNBits on its CPU provider (float32 or float16 A)."""
    elem = onnx.TensorProto.FLOAT if a.dtype == FLOAT else onnx.TensorProto.FLOAT16
    inits = [
        onnx.numpy_helper.from_array(b, "B"),
        onnx.numpy_helper.from_array(scales.reshape(-1), "scales"),
    ]
    node_inputs = ["A", "B", "scales"]
    if zp is not None:
        inits.append(onnx.numpy_helper.from_array(zp, "zero_points"))
        node_inputs.append("zero_points")
    node = oh.make_node(
        "MatMulNBits", node_inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=block_size
    )
    graph = oh.make_graph(
        [node], "nbits", [oh.make_tensor_value_info("A", elem, list(a.shape))],
        [oh.make_tensor_value_info("Y", elem, None)], initializer=inits,
    )  # fmt: skip
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(with_supported_ir(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"A": a})[0]


@pytest.mark.parametrize("t", [FLOAT, FLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize(
    ("k", "n", "block_size", "zero_points"),
    [(100, 40, 32, True), (96, 24, 32, True), (4100, 72, 128, False), (200, 17, 16, True), (256, 64, 64, False)],
)
@pytest.mark.parametrize("m", [1, 5, 9])
def test_int4_layout_matches_ort_matmul_nbits(t, k, n, block_size, zero_points, m):
    """ORT's CPU MatMulNBits on the same bytes: the nibble order, the zero points' packing (an odd number of blocks
    per row: a half-used last byte) and the padded last block are its. Both results are within the float64 budget
    of the reference's dequantization, and within twice the budget of each other."""
    rng = np.random.default_rng([k, n, block_size, m])
    a = activations(rng, (m, k), t)
    b, scales, zp = int4_weight(rng, k, n, block_size, t, zero_points)
    w = dequantize(b, scales, zp, k=k, n=n, block_size=block_size)
    theirs = ort_cpu_matmul_nbits(a, b, scales, zp, k=k, n=n, block_size=block_size).astype(t)
    assert_within_budget(theirs, a, w, "ORT's CPU MatMulNBits against the reference")
    ours = run_nbits(a, b, scales, zp, k=k, n=n, block_size=block_size)
    assert_within_budget(ours, a, w, "ours against the reference")
    from fusion.reference.decode_matmul import budget

    gap = np.abs(ours.astype(np.float64) - theirs.astype(np.float64))
    assert np.all(gap <= 2 * budget(a, w, t)), f"max gap {gap.max()}"


def bound_session(model: onnx.ModelProto, feeds: dict[str, np.ndarray], out_shape, graph: bool):
    """A session with io_binding on device buffers; returns (session, binding, input values, output value)."""
    options = {"enable_cuda_graph": "1"} if graph else {}
    sess = cuda_session(model, **options)
    binding = sess.io_binding()
    values = {}
    for name, value in feeds.items():
        values[name] = ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0)
        binding.bind_ortvalue_input(name, values[name])
    out = ort.OrtValue.ortvalue_from_shape_and_type(out_shape, np.float16, "cuda", 0)
    binding.bind_ortvalue_output("Y", out)
    return sess, binding, values, out


@pytest.mark.parametrize("op", ["DecodeMatMul", "DecodeMatMulNBits"])
def test_cuda_graph_replay_equals_the_uncaptured_run(op):
    """ORT's CUDA graph (captured after its warm-up run): each new token's A written into the bound buffer gives
    the uncaptured session's Y bit for bit (the kernels sum in a fixed order; nothing allocates or syncs)."""
    rng = np.random.default_rng(5)
    k, n = 4096, 4096
    if op == "DecodeMatMul":
        weights = {"B": (activations(rng, (k, n), np.float32) * 0.02).astype(FLOAT16)}
        a0 = activations(rng, (1, k), FLOAT16)
        model = one_node_model(op, [("A", a0), ("B", weights["B"])], [("Y", FLOAT16)])
    else:
        b, scales, zp = int4_weight(rng, k, n, 32, FLOAT16, True)
        weights = {"B": b, "scales": scales, "zero_points": zp}
        a0 = activations(rng, (1, k), FLOAT16)
        model = nbits_model(a0, b, scales, zp, k=k, n=n, block_size=32)
    captured = bound_session(model, {"A": a0, **weights}, (1, n), graph=True)
    plain = bound_session(model, {"A": a0, **weights}, (1, n), graph=False)
    for step in range(4):
        a = a0 if step == 0 else activations(rng, (1, k), FLOAT16)
        results = []
        for sess, binding, values, out in (captured, plain):
            values["A"].update_inplace(a)
            sess.run_with_iobinding(binding)
            results.append(out.numpy().copy())
        np.testing.assert_array_equal(results[0].view(np.uint16), results[1].view(np.uint16), err_msg=f"step {step}")


def test_empty_and_zero_length_products():
    """M = 0 gives an empty Y (nothing launched); K = 0 gives zeros, as MatMul does."""
    rng = np.random.default_rng(0)
    y = run_dense(np.zeros((0, 64), FLOAT16), activations(rng, (64, 40), FLOAT16))
    assert y.shape == (0, 40)
    y = run_dense(np.zeros((3, 0), FLOAT), np.zeros((0, 40), FLOAT))
    np.testing.assert_array_equal(y, np.zeros((3, 40), FLOAT))
    b, scales, zp = int4_weight(rng, 64, 40, 32, FLOAT16, True)
    y = run_nbits(np.zeros((0, 64), FLOAT16), b, scales, zp, k=64, n=40, block_size=32)
    assert y.shape == (0, 40)


def test_special_values_propagate():
    """A NaN in A's row 0 reaches every output of row 0 and no other; an infinite weight gives infinities."""
    rng = np.random.default_rng(1)
    a = activations(rng, (3, 300), FLOAT16)
    b = activations(rng, (300, 64), FLOAT16)
    a[0, 17] = np.nan
    b[5, 9] = np.inf
    a[1, 5] = 1.0
    a[2, 5] = 1.0
    y = run_dense(a, b).astype(np.float32)
    assert np.isnan(y[0]).all()
    assert not np.isnan(y[1:]).any()
    assert np.isposinf(y[1:, 9]).all()


def _dense_inputs():
    rng = np.random.default_rng(0)
    return {"A": activations(rng, (2, 64), FLOAT16), "B": activations(rng, (64, 40), FLOAT16)}


BAD_DENSE = {
    "K mismatch": (lambda i: i.update(A=i["A"][:, :60]), "A's last dim 60 must equal K = 64"),
    "B rank": (lambda i: i.update(B=i["B"].reshape(64, 5, 8)), "B must be a 2-D"),
    "B type": (lambda i: i.update(B=i["B"].astype(np.float32)), "B must have A's type float16"),
    "A type": (lambda i: i.update(A=i["A"].astype(np.int32), B=i["B"].astype(np.int32)), "A must be float, float16"),
}


@pytest.mark.parametrize("case", BAD_DENSE)
def test_bad_dense_inputs_are_errors(case):
    change, message = BAD_DENSE[case]
    inputs = _dense_inputs()
    change(inputs)
    model = one_node_model("DecodeMatMul", list(inputs.items()), [("Y", inputs["A"].dtype)], dynamic=True)
    with pytest.raises(Exception, match=f"DecodeMatMul: .*{message}"):
        cuda_session(model).run(None, feeds_of(inputs.items()))


def _nbits_inputs():
    rng = np.random.default_rng(0)
    b, scales, zp = int4_weight(rng, 100, 40, 32, FLOAT16, True)
    return {"A": activations(rng, (2, 100), FLOAT16), "B": b, "scales": scales, "zero_points": zp}


BAD_NBITS = {
    "K mismatch": (lambda i: i.update(A=i["A"][:, :96]), {}, "A's last dim 96 must equal K = 100"),
    "B size": (lambda i: i.update(B=i["B"][:, :3]), {}, "B must hold N \\* ceil"),
    "B type": (lambda i: i.update(B=i["B"].astype(np.int8)), {}, "B must be uint8"),
    "scales size": (lambda i: i.update(scales=i["scales"][:, :3]), {}, "scales must hold N \\* ceil"),
    "scales type": (lambda i: i.update(scales=i["scales"].astype(np.float32)), {}, "scales must have A's type"),
    "zero_points size": (lambda i: i.update(zero_points=i["zero_points"][:7]), {}, "zero_points must hold"),
    "zero_points unpacked": (
        lambda i: i.update(zero_points=np.full((40, 4), 8, np.float16)), {}, "zero_points must be packed uint8"),
    "bits": (lambda i: None, {"bits": 8}, "the attribute bits must be 4"),
    "block_size": (lambda i: None, {"block_size": 24}, "block_size must be a power of two"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_NBITS)
def test_bad_nbits_inputs_are_errors(case):
    change, attrs, message = BAD_NBITS[case]
    inputs = _nbits_inputs()
    change(inputs)
    attributes = {"K": 100, "N": 40, "bits": 4, "block_size": 32, **attrs}
    model = one_node_model("DecodeMatMulNBits", list(inputs.items()), [("Y", FLOAT16)], dynamic=True, **attributes)
    with pytest.raises(Exception, match=f"DecodeMatMulNBits: .*{message}"):
        cuda_session(model).run(None, feeds_of(inputs.items()))


def test_the_nodes_run_on_the_cuda_provider(tmp_path):
    """ORT's profile names the provider that ran each node: CUDA's (the library's kernels)."""
    import json
    from pathlib import Path

    inputs = _nbits_inputs()
    model = nbits_model(*inputs.values(), k=100, n=40, block_size=32)
    sess = cuda_session(model, profile_prefix=str(tmp_path / "profile"))
    sess.run(None, feeds_of(inputs.items()))
    events = json.loads(Path(sess.end_profiling()).read_text())
    providers = {
        e["args"].get("provider")
        for e in events
        if e.get("cat") == "Node" and e.get("args", {}).get("op_name") == "DecodeMatMulNBits"
    }
    assert providers == {CUDA}, providers


def test_a_cpu_session_with_the_cuda_library_runs_the_functions():
    """The CUDA-built library declares the two ops only to a session that prefers a GPU (contrib_ops.session sets
    mambafuse.prefill_cpu_kernels = 0 there): a CPU session with it inlines their functions and computes what the
    replaced MatMul and MatMulNBits compute, bit for bit, instead of failing for want of a CPU kernel."""
    import contrib_ops
    from fusion.function.decode_matmul import make_function, make_nbits_function

    rng = np.random.default_rng(7)
    k, n, block = 100, 24, 32
    blocks = blocks_of(k, block)
    packed = rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8)
    scales = (rng.standard_normal(n * blocks) * 0.1).astype(np.float32)
    weight = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    a = rng.standard_normal((3, k)).astype(np.float32)
    attributes = {"K": k, "N": n, "bits": 4, "block_size": block}

    def model(fused: bool) -> onnx.ModelProto:
        nodes = [
            oh.make_node("DecodeMatMul" if fused else "MatMul", ["A", "W"], ["Y"], domain=DOMAIN if fused else ""),
            oh.make_node(
                "DecodeMatMulNBits" if fused else "MatMulNBits",
                ["A", "B", "S"],
                ["Z"],
                domain=DOMAIN if fused else "com.microsoft",
                **attributes,
            ),
        ]
        graph = oh.make_graph(
            nodes,
            "products",
            [oh.make_tensor_value_info("A", onnx.TensorProto.FLOAT, [3, k])],
            [oh.make_tensor_value_info(y, onnx.TensorProto.FLOAT, [3, n]) for y in ("Y", "Z")],
            [onnx.numpy_helper.from_array(v, name) for name, v in (("W", weight), ("B", packed), ("S", scales))],
        )
        opsets = [oh.make_opsetid("", 21), oh.make_opsetid("com.microsoft", 1), oh.make_opsetid(DOMAIN, 1)]
        functions = [make_function(21), make_nbits_function(21)] if fused else []
        return oh.make_model(graph, opset_imports=opsets, functions=functions)

    expected = contrib_ops.session(with_supported_ir(model(False)), use_library=False).run(None, {"A": a})
    actual = contrib_ops.session(with_supported_ir(model(True)), use_library=True).run(None, {"A": a})
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(got, want)
