"""The mobius builds of ``tests/fixtures/mobius`` (``python -m models.mobius``): intact, reproducible, fused.

- the archive holds every build of the generator's matrix, file for file as the manifest lists them, and
  the set stays within its size budget;
- the gated-norm chains found in each build are the manifest's (one per Mamba layer);
- ONNX Runtime CPU reproduces the stored references of every original model it runs (f32, f16), and
  the fp16 RMSNormalization rounding the manifest records;
- ``fusion.rewrite`` fuses every gated norm (count = Mamba layers, nothing refused, no chain left), and the
  fused model runs in ORT CPU with the custom-op library and through the model-local function: every fused
  node within the op's accuracy budget (docs/op.md) of the float64 reference on the inputs ORT fed it, and
  every model output within the whole-model tolerance of ORT's run of the original.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fusion import rewrite
from fusion.reference import budget_report, onnx_type_to_dtype, reference_for_budget
from models.mobius import (
    FIXTURE_DIR,
    build_jobs,
    chain_forms,
    cpu_session,
    extract_builds,
    load_manifest,
    load_references,
    reference_feeds,
    rms_rounding,
)

MANIFEST = load_manifest()
RECORDS = {r["stem"]: r for r in MANIFEST["builds"]}
BUILT = sorted(stem for stem, r in RECORDS.items() if "error" not in r)
WITH_REFERENCES = sorted(stem for stem in BUILT if "references" in RECORDS[stem])
OWN_REFERENCES = [stem for stem in WITH_REFERENCES if RECORDS[stem]["references"] == stem]
ROUNDING = sorted(stem for stem in BUILT if "ort_rms_rounding" in RECORDS[stem])
SIZE_BUDGET = 3 * 1024 * 1024
OP_TYPE = "GatedGroupRMSNorm"

#: Whole-model outputs, fused vs original, max |difference| / max |output| per output (the bounds of
#: tests/test_models_fusion.py: fp32 1e-5; fp16 4e-3, a few fp16 ulps of the output scale).
MODEL_TOLERANCE = {"f32": 1e-5, "f16": 4e-3}


@pytest.fixture(scope="session")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return extract_builds(tmp_path_factory.mktemp("mobius-builds"))


def test_every_build_of_the_matrix_is_recorded() -> None:
    assert [j["stem"] for j in build_jobs()] == [r["stem"] for r in MANIFEST["builds"]]
    failed = {stem: r["error"] for stem, r in RECORDS.items() if "error" in r}
    assert failed == {}, f"mobius failed: {failed}"


def test_archive_matches_manifest(builds: Path) -> None:
    assert sorted(p.name for p in builds.iterdir()) == BUILT
    for stem in BUILT:
        files = {p.name: p.stat().st_size for p in (builds / stem).iterdir()}
        assert files == RECORDS[stem]["files"], stem
        if "model_same_as" in RECORDS[stem]:
            other = builds / RECORDS[stem]["model_same_as"]
            for name in ("model.onnx", "model.onnx.data"):
                assert (builds / stem / name).read_bytes() == (other / name).read_bytes()


def test_size_budget() -> None:
    total = sum(p.stat().st_size for p in FIXTURE_DIR.rglob("*") if p.is_file())
    assert total <= SIZE_BUDGET, f"{total / 2**20:.2f} MiB > {SIZE_BUDGET / 2**20:.0f} MiB"


@pytest.mark.parametrize("stem", BUILT)
def test_chains_as_recorded(stem: str, builds: Path) -> None:
    record = RECORDS[stem]
    chains = chain_forms(builds / stem / "model.onnx")
    assert len(chains) == record["expected_chains"] == record["mamba_layers"]
    keys = ("form", "ops", "steps", "y", "z", "output_type")
    assert [{k: c[k] for k in keys} for c in chains] == [{k: c[k] for k in keys} for c in record["chains"]["details"]]


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """Return max |actual - expected| / max |expected| (0 for an all-zero expected that is matched)."""
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    assert a.shape == e.shape
    scale = float(np.abs(e).max()) or 1.0
    return float(np.abs(a - e).max()) / scale


def _run_phases(session, refs) -> dict[str, dict[str, np.ndarray]]:
    names = [o.name for o in session.get_outputs()]
    return {
        phase: dict(zip(names, session.run(None, reference_feeds(refs, phase)), strict=True))
        for phase in ("prefill", "decode")
    }


@pytest.mark.parametrize("stem", OWN_REFERENCES)
def test_references_reproduce(stem: str, builds: Path) -> None:
    refs = load_references(stem)
    outputs = _run_phases(cpu_session(builds / stem / "model.onnx"), refs)
    tolerance = 1e-6 if RECORDS[stem]["dtype"] == "f32" else 1e-3
    for phase, values in outputs.items():
        for name, value in values.items():
            error = relative_error(value, refs[phase]["output"][name])
            assert error <= tolerance, f"{phase}/{name}: {error:.2e}"


@pytest.mark.parametrize("stem", ROUNDING)
def test_rms_rounding_as_recorded(stem: str, builds: Path) -> None:
    """ORT CPU's fp16 RMSNormalization still rounds as recorded (once, after the scale multiply)."""
    record = RECORDS[stem]
    counts = rms_rounding(builds / stem / "model.onnx", record["checkpoint"], record["chains"]["details"])
    assert counts == record["ort_rms_rounding"]


# --- fusion -------------------------------------------------------------------------------------------


def _fused(builds: Path, stem: str, tmp_path: Path) -> tuple[Path, rewrite.Report]:
    model = rewrite.load(builds / stem / "model.onnx")
    fused, report = rewrite.rewrite_model(model)
    output = tmp_path / "model.onnx"
    rewrite.save(fused, output)
    return output, report


@pytest.mark.parametrize("stem", BUILT)
def test_every_gated_norm_fused(stem: str, builds: Path, tmp_path: Path) -> None:
    record = RECORDS[stem]
    output, report = _fused(builds, stem, tmp_path)
    assert report.refused == [], report.summary()
    assert report.fused == record["mamba_layers"], report.summary()
    model = onnx.load(output, load_external_data=False)
    assert sum(n.op_type == OP_TYPE for n in model.graph.node) == record["mamba_layers"]
    assert chain_forms(output) == [], "a gated-norm chain is left in the fused model"


def _with_outputs(path: Path, names: list[str], dest: Path) -> Path:
    model = onnx.load(path)
    model.graph.output.extend(helper.make_value_info(name, onnx.TypeProto()) for name in names)
    onnx.save(model, dest, save_as_external_data=True, location=dest.name + ".data")
    return dest


def _fused_nodes(path: Path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(path, load_external_data=False).graph.node if n.op_type == OP_TYPE]


def _reference_inputs(node: onnx.NodeProto, values: dict[str, np.ndarray], model: Path) -> dict:
    """Return ``reference_for_budget`` of a fused node on the inputs ORT fed it (weight from the model)."""
    weights = {t.name: t for t in onnx.load(model).graph.initializer}
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    dtype = {k: onnx_type_to_dtype(attrs[k]) for k in ("norm_dtype", "output_dtype", "gated_dtype") if k in attrs}
    w = values[node.input[2]] if node.input[2] in values else numpy_helper.to_array(weights[node.input[2]])
    return reference_for_budget(
        values[node.input[0]],
        values[node.input[1]],
        w,
        epsilon=attrs["epsilon"],
        group_size=attrs["group_size"],
        **dtype,
    )


def _original_chain_outputs(original: Path, fused: Path, nodes: list[onnx.NodeProto]) -> list[str]:
    """Return, per fused node, the original chain's output (the value its out-projection reads there)."""
    chain_outputs = {c["output"] for c in chain_forms(original)}
    readers = {
        n.name: i
        for n in onnx.load(original, load_external_data=False).graph.node
        for i in n.input
        if i in chain_outputs
    }
    fused_readers = {i: n.name for n in onnx.load(fused, load_external_data=False).graph.node for i in n.input}
    return [readers[fused_readers[node.output[0]]] for node in nodes]


@pytest.mark.parametrize("library_mode", ["library", "function"])
@pytest.mark.parametrize("stem", WITH_REFERENCES)
def test_fused_parity(stem: str, library_mode: str, builds: Path, tmp_path: Path, library: str) -> None:
    """Every fused node within the op budget; every model output close to ORT's run of the original.

    With the library, each fused node is judged against the float64 reference on the inputs ORT fed it.
    Through the function, the first fused node against ORT's run of the first original chain (the one
    chain whose inputs are bit-identical in both graphs; later chains see the last-bit differences of
    the layers before them, which the model outputs carry). Not the reference there: in an fp16 graph
    ORT CPU widens y through its fp16 fallback and drops the graph's Cast(y -> f32) together with its own
    Cast(-> f16), in the original chain and in the inlined function body alike, so both read y unrounded
    where the kernel, like the contract, reads the f16 y.
    """
    record = RECORDS[stem]
    refs = load_references(record["references"])
    original = builds / stem / "model.onnx"
    fused, _ = _fused(builds, stem, tmp_path)
    nodes = _fused_nodes(fused)
    chain_outputs = _original_chain_outputs(original, fused, nodes)
    probes = sorted({name for n in nodes for name in [*n.input[:2], n.output[0]]})
    with_library = library_mode == "library"
    actual = _run_phases(cpu_session(_with_outputs(fused, probes, tmp_path / "probe.onnx"), library=with_library), refs)
    expected = _run_phases(cpu_session(_with_outputs(original, chain_outputs, tmp_path / "original.onnx")), refs)
    tolerance = MODEL_TOLERANCE[record["dtype"]]
    for phase in ("prefill", "decode"):
        values = actual[phase]
        for index, (node, chain_output) in enumerate(zip(nodes, chain_outputs, strict=True)):
            result = values[node.output[0]]
            if with_library:
                ok, message = budget_report(result, **_reference_inputs(node, values, fused))
            elif index == 0:
                ok, message = budget_report(result, expected[phase][chain_output].reshape(result.shape))
            else:
                continue
            assert ok, f"{phase}, {node.name} ({library_mode}): {message}"
        for name, reference in refs[phase]["output"].items():
            error = relative_error(values[name], reference)
            assert error <= tolerance, f"{phase}/{name}: {error:.2e} of its scale (limit {tolerance:g})"


BF16_BUILDS = sorted(stem for stem in BUILT if RECORDS[stem]["dtype"] == "bf16")


def _sibling_with_references(stem: str) -> str:
    """Return the f32 build of the same checkpoint, variant and target (its chain inputs are real data)."""
    record = RECORDS[stem]
    sibling = f"{record['checkpoint']}-f32-{record['variant']}-{record['target']}"
    return RECORDS[sibling]["references"]


@pytest.mark.parametrize("stem", BF16_BUILDS)
def test_bf16_fused_nodes_on_cpu(stem: str, builds: Path, tmp_path: Path, library: str) -> None:
    """bf16 whole models do not run on ORT CPU (no bf16 MatMul); each fused bf16 node does, with the library.

    Each fused node of the bf16 build, with its attributes and its bf16 weight, in a one-node model
    wrapped in Casts (numpy has no bf16), on the real chain inputs of the f32 build of the same checkpoint
    rounded to bf16; against the float64 reference at the op budget.
    """
    import ml_dtypes

    fused, report = _fused(builds, stem, tmp_path)
    assert report.fused == RECORDS[stem]["mamba_layers"]
    sibling = _sibling_with_references(stem)
    (tmp_path / "sibling").mkdir()
    sibling_fused, _ = _fused(builds, sibling, tmp_path / "sibling")
    sibling_nodes = _fused_nodes(sibling_fused)
    probe = _with_outputs(sibling_fused, sorted({i for n in sibling_nodes for i in n.input[:2]}), tmp_path / "p.onnx")
    values = _run_phases(cpu_session(probe, library=True), load_references(sibling))["prefill"]
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(fused).graph.initializer}
    for node, twin in zip(_fused_nodes(fused), sibling_nodes, strict=True):
        y = values[twin.input[0]].astype(np.float32).astype(ml_dtypes.bfloat16)
        z = values[twin.input[1]].astype(np.float32).astype(ml_dtypes.bfloat16)
        w = weights[node.input[2]]
        bf16 = onnx.TensorProto.BFLOAT16
        out_type = next(a.i for a in node.attribute if a.name == "output_dtype")
        graph = helper.make_graph(
            [
                helper.make_node("Cast", ["y32"], ["y"], to=bf16),
                helper.make_node("Cast", ["z32"], ["z"], to=bf16),
                helper.make_node(
                    node.op_type,
                    ["y", "z", "w"],
                    ["o"],
                    domain=node.domain,
                    **{a.name: helper.get_attribute_value(a) for a in node.attribute},
                ),
                helper.make_node("Cast", ["o"], ["o32"], to=onnx.TensorProto.FLOAT),
            ],
            "one_node",
            [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, y.shape) for n in ("y32", "z32")],
            [helper.make_tensor_value_info("o32", onnx.TensorProto.FLOAT, y.shape)],
            [numpy_helper.from_array(w, "w")],
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(node.domain, 1)], ir_version=10
        )
        path = tmp_path / f"{node.name or 'node'}.onnx"
        onnx.save(model, path)
        session = cpu_session(path, library=True)
        out = session.run(None, {"y32": y.astype(np.float32), "z32": z.astype(np.float32)})[0]
        actual = out.astype(onnx_type_to_dtype(out_type))
        ok, message = budget_report(actual, **_reference_inputs(node, {node.input[0]: y, node.input[1]: z}, fused))
        assert ok, f"{node.name}: {message}"


# --- the wrapper's workarounds (models.mobius._build_one) --------------------------------------------------------


def test_layer_types_mobius_misreads() -> None:
    """transformers 5.x layer type names, given to mobius in its own names; configs mobius reads right untouched."""
    from types import SimpleNamespace

    from models.mobius import mobius_layer_types

    nemotron = SimpleNamespace(model_type="nemotron_h")
    assert mobius_layer_types(nemotron, ["linear_attention", "full_attention", "mlp"]) == [
        "mamba2",
        "full_attention",
        "mlp",
    ]
    assert mobius_layer_types(nemotron, ["mamba2", "full_attention"]) is None
    for model_type in ("bamba", "granitemoehybrid"):
        hybrid = SimpleNamespace(model_type=model_type, layers_block_type=["linear_attention", "full_attention"])
        # mobius 0.1.0 derives ["mamba2", "mamba2"]: the attention layer as a Mamba layer without weights.
        assert mobius_layer_types(hybrid, ["mamba2", "mamba2"]) == ["mamba2", "full_attention"]
        old_names = SimpleNamespace(model_type=model_type, layers_block_type=["mamba", "attention"])
        assert mobius_layer_types(old_names, ["mamba2", "full_attention"]) is None
    assert mobius_layer_types(SimpleNamespace(model_type="zamba2"), ["mamba2"]) is None


#: Checkpoints plain ``mobius build`` (mobius-onnx 0.1.0) fails on or builds wrong, and what the wrapper fixes:
#: family -> config overrides of models.build's tiny config.
WRAPPER_CASES = {
    # "Linear-attention cache inputs requested"; and with tie_word_embeddings (the tiny config's) mobius ties
    # lm_head to the embedding, which transformers' NemotronH never does: silently wrong logits.
    "nemotron_h": {},
    # use_shared_attention_adapter=False (the tiny config's): "6 initializer(s) without weights". One group:
    # mobius normalizes Zamba2's gated norm over all channels (a mobius bug the wrapper does not change).
    "zamba2": {"mamba_ngroups": 1},
    # "8 initializer(s) without weights: 'model.layers.1.mamba.A_log'" (the attention layer built as Mamba); and
    # mobius ignores the embedding / attention / logits multipliers. One group, as for Zamba2.
    "granitemoehybrid": {
        "mamba_n_groups": 1,
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.05,
        "logits_scaling": 6.0,
        "residual_multiplier": 0.22,
    },
    # The attention layer built as Mamba, as GraniteMoeHybrid; head_dim 32 (ONNX Runtime's CPU
    # GroupQueryAttention refuses the tiny config's 8).
    "bamba": {"hidden_size": 64, "mamba_expand": 1, "num_attention_heads": 2, "num_key_value_heads": 1},
}


#: Logits of the wrapper's build vs transformers', max |difference| / max |logit|. Zamba2: mobius' shared attention
#: block differs from transformers' by ~1e-5 of the logits' scale whether or not the checkpoint has adapters
#: (measured 1.5e-5 without, 4.1e-5 with adapters; a Zamba2 without hybrid layers: 1.7e-7), which the
#: wrapper does not touch; ``test_zamba2_without_adapters_builds_zero_adapters`` checks the adapters' part exactly.
WRAPPER_TOLERANCE = {"zamba2": 1e-4}


def _checkpoint(family: str, folder: Path, **overrides: object) -> object:
    """Save a seeded random transformers model of ``family``'s tiny config (with ``overrides``); return it."""
    import torch
    import transformers

    from models.build import make_config
    from models.mobius import write_tokenizer

    config = make_config(family)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model


def _wrapper_build(checkpoint: Path, out: Path) -> Path:
    """Run ``python -m models.mobius mobius build`` (f32, cpu target); return the model it wrote."""
    import subprocess
    import sys

    built = subprocess.run(
        [sys.executable, "-m", "models.mobius", "mobius", "build", "--model", str(checkpoint), str(out)]
        + ["--dtype", "f32", "--ep", "cpu"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    return out / "model.onnx"


def _prompt_logits(model: Path, seed: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    from models.mobius import sample_feeds

    feeds, _ = sample_feeds(model, seed)
    session = cpu_session(model)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))["logits"], feeds


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(WRAPPER_CASES))
def test_the_wrapper_builds_what_transformers_computes(family: str, tmp_path: Path) -> None:
    """``python -m models.mobius mobius build`` on a checkpoint saved by transformers: the build succeeds and its
    prompt-step logits (ONNX Runtime CPU, f32) equal transformers' within 1e-5 of their scale."""
    pytest.importorskip("mobius", reason="mobius-onnx is not installed (pip install -e '.[models]')")
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[models]')")
    pytest.importorskip("transformers")

    model = _checkpoint(family, tmp_path / "checkpoint", **WRAPPER_CASES[family])
    logits, feeds = _prompt_logits(_wrapper_build(tmp_path / "checkpoint", tmp_path / "build"), family)
    with torch.no_grad():
        expected = model(torch.from_numpy(feeds["input_ids"]), use_cache=False).logits.numpy()
    error = relative_error(logits, expected)
    limit = WRAPPER_TOLERANCE.get(family, 1e-5)
    assert error <= limit, f"{family}: mobius build vs transformers {error:.2e} of the logits' scale (limit {limit})"


@pytest.mark.slow
def test_zamba2_without_adapters_builds_zero_adapters(tmp_path: Path) -> None:
    """The wrapper's Zamba2 without attention adapters computes what mobius builds for the same checkpoint with
    adapters of zero weights (transformers adds no adapter then: it is the same function)."""
    pytest.importorskip("mobius", reason="mobius-onnx is not installed (pip install -e '.[models]')")
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[models]')")

    overrides = WRAPPER_CASES["zamba2"]
    plain = _checkpoint("zamba2", tmp_path / "plain", **overrides)
    with_adapters = _checkpoint("zamba2", tmp_path / "adapters", **overrides, use_shared_attention_adapter=True)
    state = plain.state_dict()
    with torch.no_grad():
        for name, value in with_adapters.state_dict().items():
            value.copy_(state[name] if name in state else torch.zeros_like(value))
    with_adapters.save_pretrained(tmp_path / "adapters")
    without, _ = _prompt_logits(_wrapper_build(tmp_path / "plain", tmp_path / "build-plain"), "zamba2")
    zero, _ = _prompt_logits(_wrapper_build(tmp_path / "adapters", tmp_path / "build-adapters"), "zamba2")
    error = relative_error(without, zero)
    assert error <= 1e-6, f"without adapters vs zero adapters: {error:.2e} of the logits' scale"


@pytest.mark.slow
@pytest.mark.parametrize(
    "stem", [f"{checkpoint}-f32-default-cpu" for checkpoint in ("nemotron_h-g4", "zamba2-g2", "mamba2-g4")]
)
def test_the_wrapper_rebuilds_the_committed_builds_byte_for_byte(stem: str, builds: Path, tmp_path: Path) -> None:
    """The workarounds apply only where a checkpoint needs them: the fixtures' checkpoints, rebuilt through the
    wrapper now, give the committed model.onnx and data byte for byte."""
    pytest.importorskip("mobius", reason="mobius-onnx is not installed (pip install -e '.[models]')")
    pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[models]')")
    from models.mobius import _model_digest, run_build, write_checkpoint

    job = next(j for j in build_jobs() if j["stem"] == stem)
    write_checkpoint(job["checkpoint"], tmp_path / job["checkpoint"])
    record = run_build(job, tmp_path, tmp_path / "builds" / stem)
    assert "error" not in record, record["error"]
    assert _model_digest(tmp_path / "builds" / stem) == _model_digest(builds / stem)
