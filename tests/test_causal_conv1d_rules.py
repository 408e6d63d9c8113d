"""The CausalConv1d rule (fusion/rules/causal_conv1d.py) on the graphs exporters write.

* The prefill fixtures of every family and exporter (transformers 5.24 and 5.25): every prompt conv fuses, and the
  fused chain's output (through the op's model-local function, without the library) equals the original's within
  the float32 sum's and the half type's rounding.
* transformers' own ``causal_conv1d_forward`` computation (Transpose, depthwise Conv, Slice, SiLU, Transpose
  back) exported by torch.onnx with a dynamic prompt length: the fused node is within the op's budget
  (docs/causal_conv1d.md) at prompt lengths below, at and above the kernel width.
* A graph changed in one step (a padding that is not causal, a stride, a dilation, a slice that drops the first
  column, another group) is refused with the reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from fusion.function import causal_conv1d as conv_function
from fusion.reference.causal_conv1d import budget_report
from fusion.rules import causal_conv1d as conv_rules
from fusion.rules._log import FusionLog
from tests._prefill import FIXTURES, fixture_id, prefill_fixtures, prompt_feeds, session, with_function

CHANNELS, WIDTH = 24, 4


def _fuse(model: ir.Model) -> tuple[int, FusionLog]:
    log = FusionLog()
    return conv_rules.fuse_causal_conv1d(model, log), log


def _with_function(model: ir.Model) -> onnx.ModelProto:
    return with_function(model, conv_function.make_function(model.opset_imports[""]))


@pytest.mark.parametrize("path", prefill_fixtures(), ids=fixture_id)
def test_every_prefill_fixture_conv_fuses(path):
    model = ir.load(str(path))
    anchors = len(conv_rules.find_anchors(model.graph))
    fused, log = _fuse(model)
    if "transformers-bf16" in path.name:
        # transformers' exporter casts a bf16 prompt to float32 around a float32 Conv: not this op's types
        assert anchors == 0
        return
    assert anchors >= 1 and fused == anchors, [r.reason for r in log.chains.values()]
    assert not conv_rules.find_anchors(model.graph)
    assert all(r.attributes["activation"] == "silu" and r.attributes["width"] == 4 for r in log.chains.values())
    nodes = [n for n in model.graph if n.op_type == "CausalConv1d"]
    # the Transposes around the Conv go too (channels-last) wherever the graph transposes back, also through
    # TorchScript's Casts to the type a value already has between the SiLU and the Transpose
    assert all(n.attributes.get_int("channels_last") == 1 for n in nodes)


def _conv_outputs_exposed(model: ir.Model) -> ir.Model:
    """Make each conv chain's end (the value the rule replaces) a graph output."""
    for conv in conv_rules.find_anchors(model.graph):
        for kind in ("Transpose", "Mul", "Slice"):
            roots = [n for n in model.graph if n.op_type == kind and conv_rules._conv_behind(n, kind) is conv]
            if roots:
                model.graph.outputs.append(roots[0].outputs[0])
                break
    return model


PARITY_FIXTURES = [
    "nemotron_h-dynamo-fp32-prefill.onnx",
    "zamba2-dynamo-fp16-prefill.onnx",
    "nemotron_h-dynamo-noopt-fp32-prefill.onnx",
    "zamba2-torchscript-fp32-prefill.onnx",
    "families/falcon_h1-torchscript-fp16-prefill.onnx",
    "transformers-5.25/bamba-transformers-fp16-prefill.onnx",
    "families/falcon_h1-dynamo-fp32-prefill.onnx",
]


@pytest.mark.parametrize("name", PARITY_FIXTURES)
def test_fused_fixture_convs_equal_the_originals(name):
    model = _conv_outputs_exposed(ir.load(str(FIXTURES / name)))
    exposed = len(model.graph.outputs)
    original = ir.serde.serialize_model(model)
    fused, _ = _fuse(model)
    assert fused >= 1
    before, after = session(original), session(_with_function(model))
    rng = np.random.default_rng(0)
    half = "fp16" in name
    for length in (1, WIDTH - 1, WIDTH, 2 * WIDTH + 1):
        feeds = prompt_feeds(before, length, rng)
        expected, got = before.run(None, feeds), after.run(None, feeds)
        assert len(expected) == exposed
        for a, b in zip(expected[1:], got[1:], strict=True):
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            # float32: the sum's order and the sigmoid's formula; float16: ONNX Runtime's half Conv rounds its
            # products to float16, where the op sums in float32, so the two differ by a few half ulps of the sum's
            # terms (whose scale is the output's), more than of a small output that cancels
            tolerance = (4 * 2.0**-10 if half else 1e-5) * np.max(np.abs(a64)) + 1e-7
            assert np.all(np.abs(a64 - b64) <= tolerance), (name, length)


# transformers' computation, exported ----------------------------------------------------------------------------

torch = None


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    global torch
    torch = pytest.importorskip("torch")

    class PromptConv(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv1d(CHANNELS, CHANNELS, WIDTH, groups=CHANNELS, padding=WIDTH - 1, bias=True)

        def forward(self, x):  # x (B, L, C), as the in_proj's split gives it
            length = x.shape[1]
            v = self.conv(x.transpose(1, 2))[..., :length]
            return torch.nn.functional.silu(v).transpose(1, 2)

    torch.manual_seed(0)
    module = PromptConv().eval()
    path = tmp_path_factory.mktemp("prompt_conv") / "conv.onnx"
    length = torch.export.Dim("length", min=2)
    program = torch.onnx.export(
        module, (torch.randn(2, 9, CHANNELS),), dynamo=True, optimize=True, dynamic_shapes=({1: length},)
    )
    program.save(str(path))
    return path


def test_exported_prompt_conv_fuses_within_the_budget(exported):
    model = ir.load(str(exported))
    fused, log = _fuse(model)
    assert fused == 1, [r.reason for r in log.chains.values()]
    node = next(n for n in model.graph if n.op_type == "CausalConv1d")
    assert node.attributes.get_int("channels_last") == 1 and node.attributes.get_int("state_width") == WIDTH - 1
    assert not [n for n in model.graph if n.op_type in ("Conv", "Transpose")]
    weight = node.inputs[1].const_value.numpy()
    bias = node.inputs[2].const_value.numpy()
    fused_session = session(_with_function(model))
    input_name = fused_session.get_inputs()[0].name
    for length in (1, 2, WIDTH - 1, WIDTH, WIDTH + 1, 40):
        x = np.random.default_rng(length).standard_normal((2, length, CHANNELS)).astype(np.float32)
        (y,) = fused_session.run(None, {input_name: x})
        state = np.concatenate([np.zeros((2, CHANNELS, WIDTH - 1), np.float32), x.transpose(0, 2, 1)], axis=2)
        state = state[:, :, -(WIDTH - 1) :]
        ok, summary = budget_report(
            y, state, x, weight, bias, None, state_width=WIDTH - 1, activation="silu", channels_last=1
        )
        assert ok, f"L={length}: {summary}"


def _mutated(path: Path, mutate) -> ir.Model:
    proto = onnx.load(str(path))
    conv = next(n for n in proto.graph.node if n.op_type == "Conv")
    mutate(proto, conv)
    return ir.serde.deserialize_model(proto)


def _set_ints(node, name, values):
    for attribute in node.attribute:
        if attribute.name == name:
            attribute.ints[:] = values
            return
    node.attribute.append(onnx.helper.make_attribute(name, values))


def _slice_start_one(proto, conv):
    sliced = next(n for n in proto.graph.node if n.op_type == "Slice" and n.input[0] == conv.output[0])
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), "start_one"))
    sliced.input[1] = "start_one"


MUTATIONS = {
    "centered padding": (lambda proto, conv: _set_ints(conv, "pads", [1, 2]), "pads"),
    "stride": (lambda proto, conv: _set_ints(conv, "strides", [2]), "strides"),
    "dilation": (lambda proto, conv: _set_ints(conv, "dilations", [2]), "dilations"),
    "slice start": (_slice_start_one, "sliced to its first L columns"),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_changed_conv_is_refused(exported, mutation):
    mutate, reason = MUTATIONS[mutation]
    fused, log = _fuse(_mutated(exported, mutate))
    assert fused == 0
    reasons = [r.reason for r in log.chains.values()]
    assert reasons and reason in reasons[0], reasons
