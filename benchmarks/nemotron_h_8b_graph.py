"""A full-depth, real-width Nemotron-H-8B-shaped decode graph, with weights as sparse external data.

The rewriter has to handle a real checkpoint's graph — tens of GB of external weights — in seconds and
without reading them. Exporting the real 8B model is out of reach here (no hub, not enough memory), so
this builds the decode graph's structure directly: every layer of the hybrid pattern with its real
weight shapes, and in every Mamba-2 layer the gated-norm chain exactly as the torch dynamo exporter
spells it (form A, dynamic shapes; form C in fp16). The weights live in one external data file created
with ``truncate``: a sparse file of the real size that occupies no disk and reads as zeros.

Dimensions are Nemotron-H-8B's (transformers' ``NemotronHConfig`` defaults): hidden 4096, 128 Mamba
heads x 64 (C = 8192) in 8 groups, state 128, conv 4, MLP 21504 (relu^2), 32 query / 8 KV heads of 128,
vocabulary 131072. The layer pattern has the published model's composition — 52 layers, 24 Mamba-2,
24 MLP, 4 attention, attention spread through the depth — and a shorter graph takes its first layers.
The stand-ins for the SSM scan and attention are a few cheap ops each: the rewriter does not look at
them, and what matters is the node count and the weight bytes around the chains.

    python -m benchmarks.nemotron_h_8b_graph --layers 52 --dtype fp32 -o /tmp/nh8b
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fusion._chains import ChainSpec, build_chain

HIDDEN = 4096
MAMBA_HEADS, HEAD_DIM, GROUPS, STATE, CONV = 128, 64, 8, 128, 4
D_INNER = MAMBA_HEADS * HEAD_DIM  # 8192
CONV_DIM = D_INNER + 2 * GROUPS * STATE  # x, B, C
IN_PROJ = 2 * D_INNER + 2 * GROUPS * STATE + MAMBA_HEADS  # z, xBC, dt
MLP = 21504
Q_HEADS, KV_HEADS, ATT_HEAD = 32, 8, 128
VOCAB = 131072
EPS = 1e-5
#: 52 layers: M = Mamba-2, - = MLP, * = attention (24 / 24 / 4).
PATTERN = "M-M-M-M*-M-M-M-M-M-M*-M-M-M-M-M-M*-M-M-M-M-M-M*-M-M-"
assert len(PATTERN) == 52 and PATTERN.count("M") == 24 and PATTERN.count("*") == 4


@dataclass
class _Builder:
    dtype: int
    data_name: str
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    outputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    #: Symbolic shapes of the residual stream and the chain outputs, as the dynamo exporter records them
    #: (ONNX shape inference alone loses the batch dim through the chain's Concat(Shape...) Reshape).
    value_info: list[onnx.ValueInfoProto] = field(default_factory=list)
    offset: int = 0

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == TensorProto.FLOAT else 2

    def weight(self, name: str, shape: list[int]) -> str:
        """Add an initializer stored in the external data file (4 KiB aligned); return its name."""
        tensor = TensorProto(name=name, data_type=self.dtype, dims=shape)
        length = int(np.prod(shape)) * self.itemsize
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", self.data_name),
            ("offset", str(self.offset)),
            ("length", str(length)),
        ):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.offset += (length + 4095) // 4096 * 4096
        self.initializers.append(tensor)
        return name

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def node(self, op: str, inputs: list[str], name: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def rms_norm(self, x: str, prefix: str) -> str:
        """The exporter's decomposed RMSNorm over the hidden axis (7 nodes)."""
        fp32 = self.node("Cast", [x], f"{prefix}_f32", to=TensorProto.FLOAT)
        sq = self.node("Pow", [fp32, self.const(f"{prefix}_two", np.array(2.0, np.float32))], f"{prefix}_sq")
        mean = self.node("ReduceMean", [sq, self.const(f"{prefix}_axes", np.array([-1]))], f"{prefix}_mean")
        var = self.node("Add", [mean, self.const(f"{prefix}_eps", np.array(EPS, np.float32))], f"{prefix}_var")
        inv = self.node("Reciprocal", [self.node("Sqrt", [var], f"{prefix}_std")], f"{prefix}_inv")
        normed = self.node("Cast", [self.node("Mul", [fp32, inv], f"{prefix}_n")], f"{prefix}_nc", to=self.dtype)
        return self.node("Mul", [self.weight(f"{prefix}.weight", [HIDDEN]), normed], f"{prefix}_out")

    def slice_last(self, x: str, start: int, end: int, name: str) -> str:
        s = self.const(f"{name}_start", np.array([start]))
        e = self.const(f"{name}_end", np.array([end]))
        return self.node("Slice", [x, s, e, self.const(f"{name}_axis", np.array([-1]))], name)

    def mamba(self, h: str, i: int, chain: onnx.ModelProto) -> str:
        p = f"layers.{i}.mixer"
        x = self.rms_norm(h, f"layers.{i}.norm")
        proj = self.node("MatMul", [x, self.weight(f"{p}.in_proj.weight", [HIDDEN, IN_PROJ])], f"{p}_in_proj")
        gate = self.slice_last(proj, 0, D_INNER, f"{p}_gate")
        xbc = self.slice_last(proj, D_INNER, D_INNER + CONV_DIM, f"{p}_xBC")
        dt = self.slice_last(proj, D_INNER + CONV_DIM, IN_PROJ, f"{p}_dt")
        # Decode-step conv with its cache: state (last CONV-1 steps) + this step, weighted sum, silu.
        conv_state = f"cache.{i}.conv"
        state_dims = ["batch", CONV_DIM, CONV - 1]
        self.inputs.append(helper.make_tensor_value_info(conv_state, self.dtype, state_dims))
        step_col = self.node("Reshape", [xbc, self.const(f"{p}_col", np.array([0, CONV_DIM, 1]))], f"{p}_xbc_col")
        window = self.node("Concat", [conv_state, step_col], f"{p}_window", axis=-1)
        new_state = self.slice_last(window, 1, CONV, f"{p}_conv_state_out")
        self.outputs.append(helper.make_tensor_value_info(new_state, self.dtype, state_dims))
        taps = self.node("Mul", [window, self.weight(f"{p}.conv1d.weight", [CONV_DIM, CONV])], f"{p}_conv_mul")
        conv = self.node("ReduceSum", [taps, self.const(f"{p}_rax", np.array([-1]))], f"{p}_conv", keepdims=0)
        conv = self.node("Unsqueeze", [conv, self.const(f"{p}_seq", np.array([1]))], f"{p}_conv_seq")
        conv = self.node("Mul", [conv, self.node("Sigmoid", [conv], f"{p}_conv_sig")], f"{p}_conv_act")
        # SSM step stand-in: y = x * D + x * softplus(dt) over heads (the scan's shapes, not its math).
        xs = self.slice_last(conv, 0, D_INNER, f"{p}_x")
        step = self.node(
            "Softplus",
            [self.node("Add", [dt, self.weight(f"{p}.dt_bias", [MAMBA_HEADS])], f"{p}_dt_b")],
            f"{p}_dt_sp",
        )
        step = self.node(
            "Expand",
            [
                self.node("Unsqueeze", [step, self.const(f"{p}_ax2", np.array([-1]))], f"{p}_dt_u"),
                self.const(f"{p}_dt_shape", np.array([1, 1, MAMBA_HEADS, HEAD_DIM])),
            ],
            f"{p}_dt_e",
        )
        heads = self.node(
            "Reshape", [xs, self.const(f"{p}_heads", np.array([0, 0, MAMBA_HEADS, HEAD_DIM]))], f"{p}_x_heads"
        )
        scanned = self.node("Mul", [heads, step], f"{p}_scan")
        scanned = self.node("Reshape", [scanned, self.const(f"{p}_flat", np.array([0, 0, D_INNER]))], f"{p}_scan_flat")
        y = self.node(
            "Add",
            [scanned, self.node("Mul", [xs, self.weight(f"{p}.D_expanded", [D_INNER])], f"{p}_xD")],
            f"{p}_y",
        )
        for value in (y, gate):
            self.value_info.append(helper.make_tensor_value_info(value, self.dtype, ["batch", "seq", D_INNER]))
        # The gated group-RMSNorm, spelled as the exporter spells it.
        y_in, z_in = (v.name for v in chain.graph.input)
        rename = {y_in: y, z_in: gate}
        out = chain.graph.output[0].name
        for node in chain.graph.node:
            if node.op_type == "Identity" and node.output[0] == out:
                out = node.input[0]
                continue
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = f"{p}.norm.{node.name or node.output[0]}"
            copy.input[:] = [rename.get(n, f"{p}.norm.{n}" if n else n) for n in node.input]
            copy.output[:] = [f"{p}.norm.{n}" for n in node.output]
            self.nodes.append(copy)
        for init in chain.graph.initializer:
            if init.name == "weight":  # the norm weight: real-size external data like every weight
                self.weight(f"{p}.norm.{init.name}", list(init.dims))
            else:
                copy = onnx.TensorProto()
                copy.CopyFrom(init)
                copy.name = f"{p}.norm.{init.name}"
                self.initializers.append(copy)
        normed = f"{p}.norm.{out}"
        self.value_info.append(helper.make_tensor_value_info(normed, self.dtype, ["batch", "seq", D_INNER]))
        o = self.node("MatMul", [normed, self.weight(f"{p}.out_proj.weight", [D_INNER, HIDDEN])], f"{p}_out_proj")
        return self.node("Add", [h, o], f"layers.{i}.residual")

    def mlp(self, h: str, i: int) -> str:
        p = f"layers.{i}.mixer"
        x = self.rms_norm(h, f"layers.{i}.norm")
        up = self.node("MatMul", [x, self.weight(f"{p}.up_proj.weight", [HIDDEN, MLP])], f"{p}_up")
        act = self.node("Relu", [up], f"{p}_relu")
        act = self.node("Mul", [act, act], f"{p}_relu2")
        down = self.node("MatMul", [act, self.weight(f"{p}.down_proj.weight", [MLP, HIDDEN])], f"{p}_down")
        return self.node("Add", [h, down], f"layers.{i}.residual")

    def attention(self, h: str, i: int) -> str:
        p = f"layers.{i}.mixer"
        x = self.rms_norm(h, f"layers.{i}.norm")
        q = self.node("MatMul", [x, self.weight(f"{p}.q_proj.weight", [HIDDEN, Q_HEADS * ATT_HEAD])], f"{p}_q")
        kv = []
        for name in ("k", "v"):
            new = self.node(
                "MatMul",
                [x, self.weight(f"{p}.{name}_proj.weight", [HIDDEN, KV_HEADS * ATT_HEAD])],
                f"{p}_{name}",
            )
            past = f"cache.{i}.{name}"
            self.inputs.append(helper.make_tensor_value_info(past, self.dtype, ["batch", "past", KV_HEADS * ATT_HEAD]))
            full = self.node("Concat", [past, new], f"{p}_{name}_cache", axis=1)
            self.outputs.append(
                helper.make_tensor_value_info(full, self.dtype, ["batch", "total", KV_HEADS * ATT_HEAD])
            )
            kv.append(full)
        # Attention stand-in with the right reads: mean of V weighted by nothing (softmax shapes omitted).
        ctx = self.node("ReduceMean", [kv[1], self.const(f"{p}_tax", np.array([1]))], f"{p}_ctx")
        ctx = self.node("Tile", [ctx, self.const(f"{p}_rep", np.array([1, 1, Q_HEADS // KV_HEADS]))], f"{p}_ctx_rep")
        mixed = self.node("Mul", [q, ctx], f"{p}_mix")
        o = self.node("MatMul", [mixed, self.weight(f"{p}.o_proj.weight", [Q_HEADS * ATT_HEAD, HIDDEN])], f"{p}_o")
        return self.node("Add", [h, o], f"layers.{i}.residual")


def chain_spec(dtype: str) -> ChainSpec:
    """Return the gated-norm chain spelling of a decode export in ``dtype`` (docs/forms.md, forms A / C)."""
    if dtype == "fp32":
        return ChainSpec(channels=D_INNER, group_size=D_INNER // GROUPS, shape_as="dynamic", leading=("batch", "seq"))
    return ChainSpec(
        channels=D_INNER,
        group_size=D_INNER // GROUPS,
        shape_as="dynamic",
        leading=("batch", "seq"),
        y_dtype=TensorProto.FLOAT16,
        z_dtype=TensorProto.FLOAT16,
        cast_y=True,
        cast_z=True,
        norm_cast=TensorProto.FLOAT16,
        weight_dtype=TensorProto.FLOAT16,
    )


def build(layers: int, out_dir: Path, dtype: str = "fp32") -> Path:
    """Write ``out_dir/model.onnx`` and its sparse ``model.data`` (first ``layers`` layers); return the path."""
    if not 1 <= layers <= len(PATTERN):
        raise ValueError(f"layers must be in 1..{len(PATTERN)}, got {layers}")
    elem = TensorProto.FLOAT if dtype == "fp32" else TensorProto.FLOAT16
    out_dir.mkdir(parents=True, exist_ok=True)
    b = _Builder(dtype=elem, data_name="model.data")
    chain = build_chain(chain_spec(dtype))
    b.inputs.append(helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]))
    h = b.node("Gather", [b.weight("embeddings.weight", [VOCAB, HIDDEN]), "input_ids"], "embed")
    for i, kind in enumerate(PATTERN[:layers]):
        h = {"M": lambda h, i: b.mamba(h, i, chain), "-": b.mlp, "*": b.attention}[kind](h, i)
        b.value_info.append(helper.make_tensor_value_info(h, elem, ["batch", "seq", HIDDEN]))
    h = b.rms_norm(h, "norm_f")
    logits = b.node("MatMul", [h, b.weight("lm_head.weight", [HIDDEN, VOCAB])], "logits")
    b.outputs.insert(0, helper.make_tensor_value_info(logits, elem, ["batch", "seq", VOCAB]))
    graph = helper.make_graph(
        b.nodes,
        "nemotron_h_8b_decode",
        b.inputs,
        b.outputs,
        initializer=b.initializers,
        value_info=b.value_info,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    data = out_dir / "model.data"
    with open(data, "wb") as f:
        f.truncate(b.offset)  # sparse: the real size, no blocks written
    path = out_dir / "model.onnx"
    onnx.save(model, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=52)
    parser.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("-o", "--out-dir", type=Path, required=True)
    args = parser.parse_args()
    path = build(args.layers, args.out_dir, args.dtype)
    size = os.path.getsize(args.out_dir / "model.data")
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB graph, {size / 1e9:.1f} GB sparse weights)")


if __name__ == "__main__":
    main()
