"""The mobius cuda-target builds of ``tests/fixtures/mobius`` under ONNX Runtime's CUDA execution provider.

Needs onnxruntime-gpu and a GPU (skipped with the reason elsewhere); the generation tests also need
onnxruntime-genai-cuda, and the library built with ``-DMAMBAFUSE_CUDA=ON`` (``$MAMBAFUSE_LIBRARY``).
``benchmarks/gpu_session.sh`` runs this module on the GPU machine (step ``mobius``).

- Which rounding ORT CUDA's half-precision RMSNormalization computes (one-node models, as mobius writes
  them): with a [gs] / [C] scale one rounding after the scale multiply, as ORT CPU and the fused node's
  attributes (norm_dtype = float); with a [G, gs] scale it scales every group by the first row — wrong.
- Every cuda-target build (Nemotron-H, Zamba2, Mamba2 x f32 / f16 / bf16 x default / workaround), fused,
  against ORT CUDA's run of the original (for grouped S1 builds, which ORT CUDA computes wrongly, of their
  workaround twin) on a prompt step and one decode step: each fused node within the op budget of the
  float64 reference on the inputs ORT fed it (with the library), the first fused node within the op budget
  of the original's first chain as ORT CUDA computed it (with the library and through the model-local
  function), every model output close to the reference's, and the fused nodes placed on the CUDA provider.
- onnxruntime-genai-cuda: greedy tokens from a fixed prompt, reference vs fused (library; function), for
  the cuda-target genai folders (``mambafuse genai --genai-config-edit``).

bf16 values cannot cross numpy: bf16 inputs are fed as bf16 OrtValues from their bits, and bf16 outputs
(and probed values) leave the model through an added Cast to float32 (exact).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fusion import rewrite
from fusion.reference import budget_report, onnx_type_to_dtype, reference_for_budget
from models.mobius import (
    extract_builds,
    load_manifest,
    load_references,
    next_step_inputs,
    present_name,
    sample_feeds,
)
from tests._cuda import CUDA, cuda_problem
from tests.test_mobius_fixtures import relative_error

ort = pytest.importorskip("onnxruntime")
if (_problem := cuda_problem(ort)) is not None:
    pytest.skip(_problem, allow_module_level=True)

MANIFEST = load_manifest()
RECORDS = {r["stem"]: r for r in MANIFEST["builds"]}
CUDA_BUILDS = sorted(s for s, r in RECORDS.items() if r["target"] == "cuda" and "error" not in r)
GENAI_CUDA_BUILDS = sorted(s for s in CUDA_BUILDS if RECORDS[s].get("runtime") == "ort-genai")
OP_TYPE = "GatedGroupRMSNorm"
FLOAT, FLOAT16, BFLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16

#: Whole-model outputs, fused vs original, max |difference| / max |output| per output: fp32 1e-5, fp16
#: 4e-3 (tests/test_mobius_fixtures.py), bf16 3.2e-2 (the fp16 bound scaled by bf16's 8x coarser ulp).
MODEL_TOLERANCE = {"f32": 1e-5, "f16": 4e-3, "bf16": 3.2e-2}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return extract_builds(tmp_path_factory.mktemp("mobius-builds"))


def cuda_session(model: onnx.ModelProto | Path, library: bool, profile: Path | None = None):
    """Return a session on the CUDA provider (CPU for what CUDA has no kernel for, as users run it)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only (ORT warns of every node the CPU provider gets)
    if library:
        import contrib_ops

        options = contrib_ops.register(options)
    if profile is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile)
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, options, providers=[CUDA, "CPUExecutionProvider"])


ORT_TYPES = {"tensor(float)": FLOAT, "tensor(float16)": FLOAT16, "tensor(bfloat16)": BFLOAT16}


def value_types(model: onnx.ModelProto, names: list[str], library: bool) -> dict[str, int]:
    """Return the element types ONNX Runtime gives ``names`` (any values of the graph) in ``model``.

    Asked of ORT, which knows the types of the com.microsoft ops' outputs that onnx's inference does not.
    """
    probe = onnx.ModelProto.FromString(model.SerializeToString())
    probe.graph.output.extend(helper.make_value_info(name, onnx.TypeProto()) for name in names)
    outputs = cuda_session(probe, library).get_outputs()
    return {o.name: ORT_TYPES[o.type] for o in outputs if o.name in names}


def float_io(model: onnx.ModelProto, probes: dict[str, int]) -> onnx.ModelProto:
    """Return a copy with ``probes`` ({value: its element type}, any values of the graph) as extra outputs,
    and every bf16 output (and probe) leaving through an exact Cast to float32; ``run`` gives them back
    under their own names, in bf16. (bf16 inputs are fed as bf16 OrtValues, see ``run``: a Cast in front
    of a cache input would let ORT write the GroupQueryAttention's present into the Cast's buffer.)"""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    outputs = [(v.name, v.type.tensor_type.elem_type) for v in graph.output] + list(probes.items())
    del graph.output[:]
    for name, elem in outputs:
        if elem == BFLOAT16:
            graph.node.append(helper.make_node("Cast", [name], [name + "__f32"], to=FLOAT))
            graph.output.append(helper.make_tensor_value_info(name + "__f32", FLOAT, None))
        else:
            graph.output.append(helper.make_tensor_value_info(name, elem, None))
    return model


def run(session, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run a ``float_io`` session; return every output under its own name and type (bf16 via ml_dtypes)."""
    bf16 = onnx_type_to_dtype(BFLOAT16)
    values = {
        name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(value.view(np.uint16), BFLOAT16)
        if value.dtype == bf16
        else ort.OrtValue.ortvalue_from_numpy(value)
        for name, value in feeds.items()
    }
    names = [o.name for o in session.get_outputs()]
    out = session.run_with_ort_values(names, values)
    return {
        name.removesuffix("__f32"): (v.numpy().astype(bf16) if name.endswith("__f32") else v.numpy())
        for name, v in zip(names, out, strict=True)
    }


def step_feeds(stem: str, builds: Path) -> tuple[dict[str, np.ndarray], Callable[[dict], dict]]:
    """Return a build's prompt-step feeds (the stored prompt of its checkpoint, empty caches; bf16 caches as
    bf16) and a function of the prompt step's outputs giving the decode step's feeds."""
    feeds, cache = sample_feeds(builds / stem / "model.onnx", RECORDS[stem]["checkpoint"])

    def decode(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return next_step_inputs(feeds, outputs) | {past: outputs[present_name(past)] for past in cache}

    return feeds, decode


def node_providers(profile_file: str) -> dict[str, str]:
    """Return {node name: provider} from an ORT profile."""
    events = json.loads(Path(profile_file).read_text())
    return {
        e["name"].removesuffix("_kernel_time"): e["args"]["provider"]
        for e in events
        if e.get("cat") == "Node" and "provider" in e.get("args", {})
    }


# --- which rounding ORT CUDA's RMSNormalization computes ----------------------------------------------


@pytest.mark.parametrize("elem", [FLOAT16, BFLOAT16], ids=["f16", "bf16"])
@pytest.mark.parametrize("shapes", [((256, 8, 1024), (8, 1024)), ((256, 4, 16), (4, 16)), ((256, 64), (64,))])
def test_cuda_rms_normalization_rounding(elem: int, shapes, tmp_path: Path) -> None:
    """ORT CUDA's opset-24 RMSNormalization in T (mobius' S1 / S3 shapes) against the candidate results.

    ``one``: round(T, f32(s) * (f32(x) * nf)) — what ORT CPU computes and the fused node's attributes
    (norm_dtype = float) encode; ``two``: round(T, f32(s) * f32(round(T, f32(x) * nf))) — the ONNX function
    body; ``first_row``: ``one`` with the scale's first row [gs] in place of every group's row. nf = 1 /
    sqrt(mean(f32(x)^2) + eps) in float32.

    Measured with onnxruntime-gpu 1.31.1: with a [gs] or [C] scale CUDA computes ``one``, as CPU does; with
    a [G, gs] scale (mobius' Nemotron-H default, G > 1) it computes ``first_row``: every group is scaled by
    group 0's weights — wrong (the graph means ``one``; ORT CPU computes it; microsoft/onnxruntime pull request
    28971 proposes the fix). A fused model computes ``one``.
    This test records that behaviour; when a release fixes it, the test fails and docs/forms.md (form I)
    and the README's GPU section must say so.
    """
    x_shape, s_shape = shapes
    eps = 1e-5
    dtype = onnx_type_to_dtype(elem)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32).astype(dtype)
    s = (1 + 0.25 * rng.standard_normal(s_shape)).astype(np.float32).astype(dtype)
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x32"], ["x"], to=elem),
            helper.make_node("RMSNormalization", ["x", "s"], ["y"], epsilon=eps, axis=-1, name="rms"),
            helper.make_node("Cast", ["y"], ["y32"], to=FLOAT),
        ],
        "rms",
        [helper.make_tensor_value_info("x32", FLOAT, x_shape)],
        [helper.make_tensor_value_info("y32", FLOAT, x_shape)],
        [numpy_helper.from_array(s, "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)
    session = cuda_session(model, library=False, profile=tmp_path / "rms")
    got = session.run(None, {"x32": x.astype(np.float32)})[0]
    provider = node_providers(session.end_profiling())["rms"]
    xf, sf = x.astype(np.float32), s.astype(np.float32)
    nf = np.float32(1) / np.sqrt((xf * xf).mean(-1, keepdims=True, dtype=np.float32) + np.float32(eps))
    normed = xf * nf

    def rounded(values: np.ndarray) -> np.ndarray:
        return values.astype(dtype).astype(np.float32)

    candidates = {
        "one_rounding": rounded(sf * normed),
        "round_before_scale": rounded(sf * rounded(normed)),
        "first_row_scale": rounded(sf.reshape(-1, s_shape[-1])[0] * normed),
    }
    counts = {name: int((got == value).sum()) for name, value in candidates.items()}
    print(
        f"RMSNormalization {onnx.TensorProto.DataType.Name(elem)} x{list(x_shape)} scale{list(s_shape)} on "
        f"{provider}: {counts} of {got.size}"
    )
    assert provider == CUDA
    grouped = len(s_shape) == 2 and s_shape[0] > 1
    expected = "first_row_scale" if grouped else "one_rounding"
    # A float32 sum of squares in another order may move nf by an ulp: allow 0.1 % of elements elsewhere.
    assert counts[expected] >= 0.999 * got.size, counts
    assert counts["one_rounding"] != counts["round_before_scale"], "the roundings agree: the check proves little"


# --- fused vs original, both on CUDA -------------------------------------------------------------------


def grouped_scale(stem: str) -> bool:
    """Whether the build's gated norms are RMSNormalization with a [G, gs] scale, G > 1 (form S1 grouped):
    the case ORT CUDA computes wrongly (test_cuda_rms_normalization_rounding)."""
    record = RECORDS[stem]
    geometry = MANIFEST["checkpoints"][record["checkpoint"]]
    return record["chains"]["forms"] == ["S1"] and geometry["group_size"] < geometry["channels"]


def reference_stem(stem: str) -> str:
    """Return the build whose ORT CUDA run a fused ``stem`` is judged against: the build itself, or for a
    grouped S1 build its twin made with mobius' workaround variable (same checkpoint and dtype; the norm
    decomposed into ops ORT CUDA computes right), since ORT CUDA's run of the S1 graph is wrong."""
    if not grouped_scale(stem):
        return stem
    record = RECORDS[stem]
    twin = f"{record['checkpoint']}-{record['dtype']}-workaround-{record['target']}"
    assert RECORDS[twin]["chains"]["forms"] == ["S2"], twin
    return twin


def _fused(builds: Path, stem: str, tmp_path: Path) -> tuple[Path, rewrite.Report]:
    fused, report = rewrite.rewrite_model(rewrite.load(builds / stem / "model.onnx"))
    output = tmp_path / "fused.onnx"
    rewrite.save(fused, output)
    return output, report


def _first_chain_output(original: onnx.ModelProto, fused: onnx.ModelProto, node: onnx.NodeProto) -> str:
    """Return the original value that the first fused node's reader reads there (that chain's output)."""
    reader = next(n for n in fused.graph.node if node.output[0] in n.input)
    original_reader = next(n for n in original.graph.node if n.name == reader.name)
    position = list(reader.input).index(node.output[0])
    return original_reader.input[position]


@pytest.mark.parametrize("library_mode", ["library", "function"])
@pytest.mark.parametrize("stem", CUDA_BUILDS)
def test_fused_parity_on_cuda(stem: str, library_mode: str, builds: Path, tmp_path: Path, library: str) -> None:
    """The fused build on CUDA against ORT CUDA's run of the original (of its workaround twin where the
    original is grouped S1): each fused node within the op budget of the float64 reference on the inputs
    ORT fed it (library), the first fused node within the op budget of the original's first chain (not
    the twin's, which rounds elsewhere), every model output within MODEL_TOLERANCE, the fused nodes on the
    CUDA provider."""
    record = RECORDS[stem]
    fused_path, report = _fused(builds, stem, tmp_path)
    assert report.fused == record["mamba_layers"] and report.refused == [], report.summary()
    fused = onnx.load(fused_path)
    nodes = [n for n in fused.graph.node if n.op_type == OP_TYPE]
    reference = reference_stem(stem)
    original = onnx.load(builds / reference / "model.onnx")
    # The twin rounds at other points (no h rounding before the norm): compared at model level only.
    first_chain = _first_chain_output(original, fused, nodes[0]) if reference == stem else None
    with_library = library_mode == "library"
    probes = sorted({name for n in nodes for name in [*n.input[:2], n.output[0]]}) if with_library else []
    probes = probes or [nodes[0].output[0]]
    fused_session = cuda_session(
        float_io(fused, value_types(fused, probes, with_library)), with_library, profile=tmp_path / "fused"
    )
    chain_probe = [first_chain] if first_chain else []
    original_session = cuda_session(float_io(original, value_types(original, chain_probe, False)), False)
    weights = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}

    prompt, decode = step_feeds(stem, builds)
    expected_prompt = run(original_session, prompt)
    steps = {"prefill": prompt, "decode": decode(expected_prompt)}
    tolerance = MODEL_TOLERANCE[record["dtype"]]
    lines = [f"judged against ORT CUDA's run of {reference}"]
    for phase, feeds in steps.items():
        expected = expected_prompt if phase == "prefill" else run(original_session, feeds)
        actual = run(fused_session, feeds)
        for index, node in enumerate(nodes if with_library else nodes[:1]):
            result = actual[node.output[0]]
            if with_library:
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                kinds = ("norm_dtype", "output_dtype", "gated_dtype")
                y, z = actual[node.input[0]], actual[node.input[1]]
                w = actual[node.input[2]] if node.input[2] in actual else weights[node.input[2]]
                ok, message = budget_report(
                    result,
                    **reference_for_budget(
                        y,
                        z,
                        w,
                        epsilon=attrs["epsilon"],
                        group_size=attrs["group_size"],
                        **{k: onnx_type_to_dtype(attrs[k]) for k in kinds if k in attrs},
                    ),
                )
                assert ok, f"{phase}, {node.name} vs the reference: {message}"
            if index == 0 and first_chain:
                chain = expected[first_chain].reshape(result.shape)
                ok, message = budget_report(result, chain)
                same = int((result.view(np.uint8) == chain.view(np.uint8)).reshape(result.size, -1).all(1).sum())
                lines.append(f"{phase}: first node vs ORT CUDA's chain: {same}/{result.size} identical; {message}")
                assert ok, f"{phase}, {node.name} vs the first chain of {reference} on CUDA: {message}"
        for name in (o.name for o in original.graph.output):
            error = relative_error(actual[name], expected[name])
            lines.append(f"{phase}/{name}: {error:.2e}")
            assert error <= tolerance, f"{phase}/{name}: {error:.2e} of its scale (limit {tolerance:g})"
    print(f"{stem} [{library_mode}]: " + "; ".join(lines))
    if with_library:
        placed = node_providers(fused_session.end_profiling())
        assert {placed[n.name] for n in nodes} == {CUDA}, {n.name: placed.get(n.name) for n in nodes}


@pytest.mark.parametrize("stem", [s for s in CUDA_BUILDS if grouped_scale(s)])
def test_grouped_original_is_wrong_on_cuda(stem: str, builds: Path) -> None:
    """ORT CUDA's run of a grouped S1 original differs from its workaround twin far beyond rounding (the
    scale bug above), where ORT CPU's runs of the two agree: the reason the fused S1 builds are judged
    against the twin. Reported, with the size of the error the fusion removes."""
    twin = reference_stem(stem)
    sessions = {
        name: cuda_session(float_io(onnx.load(builds / name / "model.onnx"), {}), False) for name in (stem, twin)
    }
    feeds, _ = step_feeds(stem, builds)
    logits = {name: run(session, feeds)["logits"] for name, session in sessions.items()}
    error = relative_error(logits[stem], logits[twin])
    print(f"{stem}: prompt logits, ORT CUDA original vs its workaround twin: {error:.3g} of their scale")
    assert error > 10 * MODEL_TOLERANCE[RECORDS[stem]["dtype"]]
    if RECORDS[stem]["dtype"] != "bf16":  # ORT CPU runs f32 / f16: the two builds agree there
        cpu = {
            name: load_references(RECORDS[name]["references"])["prefill"]["output"]["logits"] for name in (stem, twin)
        }
        assert relative_error(cpu[stem], cpu[twin]) <= MODEL_TOLERANCE[RECORDS[stem]["dtype"]]


# --- onnxruntime-genai-cuda ---------------------------------------------------------------------------


def _genai_reference(builds: Path, stem: str, dest: Path) -> Path:
    """Return the genai folder that fused ``stem`` is judged against: the original (config-edited), or for a
    grouped S1 build the same folder with its workaround twin's model.onnx and data (same input and output
    names, same weights)."""
    from tests import test_genai

    folder = test_genai._edited_original(builds / stem, dest)
    reference = reference_stem(stem)
    if reference != stem:
        for name in ("model.onnx", "model.onnx.data"):
            shutil.copyfile(builds / reference / name, folder / name)
    return folder


#: A float32 folder's logits through the model-local functions of MambaChunkScan and CausalConv1d on ONNX Runtime's
#: CUDA provider, max |difference| / max |logit|: their bodies compute the scan's chunk products with MatMul and the
#: conv with Conv, which the CUDA provider runs in TF32 by default (its use_tf32 option), float16's 10 significant
#: bits, where the builder's LinearAttention and CausalConvWithState kernels compute in float32. Measured on an H100
#: (prompt step through ORT, mamba2-g4-f32 and zamba2-g2-f32 with both opt-ins): 1.2e-3 and 2.0e-3 with use_tf32 on,
#: 3e-7 and 4e-7 with it off; through genai 2.6e-4 at most. So these runs are held to the float16 tolerance.
FUNCTION_BODY_F32 = MODEL_TOLERANCE["f16"]
#: The genai command's options the generation test runs: the folder's defaults, and the builder's scan and conv
#: run as MambaChunkScan and CausalConv1d (their CUDA kernels on the prompt and on every decode step).
GENAI_OPTIONS = {
    "defaults": (),
    "scan-conv": ("--opt-in", "linear_attention_scan", "--opt-in", "causal_conv_with_state"),
}


@pytest.mark.parametrize("options", GENAI_OPTIONS)
@pytest.mark.parametrize("stem", GENAI_CUDA_BUILDS)
def test_genai_cuda_generation_same_before_and_after_fusion(
    stem: str, options: str, builds: Path, tmp_path: Path, library: str
) -> None:
    """Greedy tokens with onnxruntime-genai-cuda, reference vs fused (library; function): identical, or a
    divergence only at a tie of the reference (test_genai._compare); logits within MODEL_TOLERANCE."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai-cuda is not installed")
    from tests import test_genai

    reference = _genai_reference(builds, stem, tmp_path / "reference")
    status, _, err = test_genai._fuse(builds / stem, tmp_path / "fused", "--genai-config-edit", *GENAI_OPTIONS[options])
    assert status == 0, err
    function_only = test_genai._without_library(tmp_path / "fused", tmp_path / "function")
    config = json.loads((tmp_path / "fused" / "genai_config.json").read_text())
    assert "cuda" in config["model"]["decoder"]["session_options"]["provider_options"][0]
    ours = {node.op_type for node in onnx.load(tmp_path / "fused" / "model.onnx").graph.node}
    if options == "scan-conv":
        assert {"MambaChunkScan", "CausalConv1d"} <= ours, sorted(ours)
    else:  # a CUDA folder's default: the convs (the toy scans stay LinearAttention, under SCAN_MIN_STATE)
        assert "CausalConv1d" in ours and "LinearAttention" in ours, sorted(ours)
    tokens, logits = test_genai.generate(reference)
    assert len(set(tokens)) > 4, f"degenerate generation {tokens}: the comparison would prove little"
    limit = MODEL_TOLERANCE[RECORDS[stem]["dtype"]] * float(np.abs(logits).max())
    for label, folder in (("library", tmp_path / "fused"), ("function", function_only)):
        if label == "function" and RECORDS[stem]["dtype"] == "f32" and ours & {"MambaChunkScan", "CausalConv1d"}:
            limit = FUNCTION_BODY_F32 * float(np.abs(logits).max())
        fused_tokens, fused_logits = test_genai.generate(folder)
        line = test_genai._compare(tokens, logits, fused_tokens, fused_logits)
        print(f"{stem} [{label}, genai-cuda, vs {reference_stem(stem)}]: {line} (limit {limit:.3g})")
        difference = float(line.rsplit("= ", 1)[1])
        assert difference <= limit, f"{label}: {line}, over {limit:.3g}"
