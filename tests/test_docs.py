"""The docs say what the code does, and never point outside the repository.

- docs/op.md's attribute table against the reference (``fusion/reference/gated_group_rms_norm.py``), the
  model-local function (``fusion/function/gated_group_rms_norm.py``) and the kernel library (a one-node model per
  default); its formula against the reference's docstring; its accuracy constants against ``budget_report``'s.
- docs/forms.md's per-exporter table against the fixtures' manifest (what the exports contain), its forms
  against the rule's classifier, and every refusal reason it quotes against the rule modules' messages.
- README.md and docs/: links resolve to files in the repository; nothing refers to files that are not
  shipped (the design notes outside the repository).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import contrib_ops
from fusion.reference import DOMAIN, OP_TYPE, bfloat16

# The op's modules (the packages re-export its names, so the attribute ``fusion.reference.gated_group_rms_norm``
# is the reference function, not the module).
reference = importlib.import_module("fusion.reference.gated_group_rms_norm")
function = importlib.import_module("fusion.function.gated_group_rms_norm")

ROOT = Path(__file__).resolve().parent.parent
OP_DOC = ROOT / "docs" / "op.md"
FORMS_DOC = ROOT / "docs" / "forms.md"
OUR_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLOAT, FLOAT16, BFLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16


def _section(text: str, heading: str) -> str:
    """Return the body of the markdown section ``heading`` (up to the next heading of any level)."""
    match = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#+ |\Z)", text, flags=re.M | re.S)
    assert match, f"section {heading!r} missing"
    return match.group(1)


def _table(section: str) -> list[list[str]]:
    """Return the rows (cells stripped) of the first markdown table in ``section``, header excluded."""
    rows = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]
    return [row for row in cells[2:]]


def _attribute_table() -> dict[str, dict[str, str]]:
    rows = _table(_section(OP_DOC.read_text(), "Attributes"))
    return {row[0].strip("`"): {"type": row[1], "default": row[2]} for row in rows}


# --- docs/op.md ---------------------------------------------------------------------------------------


def test_attribute_names_match_reference_and_function() -> None:
    documented = set(_attribute_table())
    run_params = set(inspect.signature(reference.GatedGroupRMSNorm._run).parameters) - {"self", "y", "z", "w"}
    keyword_params = {
        name
        for name, p in inspect.signature(reference.gated_group_rms_norm).parameters.items()
        if p.kind is p.KEYWORD_ONLY
        # not attributes: the evaluation's precision, and the budget's alternative references (flip_*)
        and name not in ("compute_dtype", "return_normed")
        and not name.startswith("flip_")
    }
    declared = set(function.ATTRIBUTES) | set(function.OPTIONAL_ATTRIBUTES)
    assert documented == run_params == keyword_params == declared


def test_required_and_default_columns_match_the_code() -> None:
    table = _attribute_table()
    required = {name for name, row in table.items() if row["default"] == "required"}
    assert required == {"epsilon", "group_size"}
    # The function declares exactly the documented optional defaults; the rest it needs on every node.
    for name, default in function.OPTIONAL_ATTRIBUTES.items():
        assert f"({default})" in table[name]["default"], f"{name}: doc default {table[name]['default']!r}"
    # The reference's own defaults: norm/output default to Y's type, gated to float32 (no rounding).
    signature = inspect.signature(reference.gated_group_rms_norm).parameters
    assert all(signature[name].default is None for name in ("norm_dtype", "output_dtype", "gated_dtype"))
    assert "T1" in table["norm_dtype"]["default"] and "T1" in table["output_dtype"]["default"]
    assert table["epsilon"]["type"] == "float" and table["group_size"]["type"] == "int"


def _one_node(attrs: dict[str, object], y_type: int = FLOAT16) -> onnx.ModelProto:
    node = oh.make_node(OP_TYPE, ["Y", "Z", "W"], ["O"], domain=DOMAIN, **attrs)
    inputs = [
        oh.make_tensor_value_info("Y", y_type, [2, 3, 16]),
        oh.make_tensor_value_info("Z", FLOAT, [2, 3, 16]),
        oh.make_tensor_value_info("W", FLOAT, [16]),
    ]
    graph = oh.make_graph([node], "one", inputs, [oh.make_empty_tensor_value_info("O")])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(DOMAIN, 1)], ir_version=10)


def _kernel(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = contrib_ops.register(ort.SessionOptions())
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_kernel_defaults_are_the_documented_ones(library: str) -> None:
    """Absent norm_dtype / output_dtype are Y's type (T1), absent / 0 gated_dtype is FLOAT (no rounding)."""
    rng = np.random.default_rng(0)
    feeds = {
        "Y": rng.standard_normal((2, 3, 16)).astype(np.float16),
        "Z": (3 * rng.standard_normal((2, 3, 16))).astype(np.float32),
        "W": (1 + 0.25 * rng.standard_normal(16)).astype(np.float32),
    }
    base = {"epsilon": 1e-5, "group_size": 8}
    implicit = _kernel(_one_node(base), feeds)
    explicit = _kernel(_one_node({**base, "norm_dtype": FLOAT16, "output_dtype": FLOAT16, "gated_dtype": FLOAT}), feeds)
    zeros = _kernel(_one_node({**base, "norm_dtype": 0, "output_dtype": 0, "gated_dtype": 0}), feeds)
    assert implicit.dtype == np.float16  # output_dtype defaults to Y's type (not all inputs are float32)
    np.testing.assert_array_equal(implicit, explicit)
    np.testing.assert_array_equal(implicit, zeros)
    expected = reference.gated_group_rms_norm(feeds["Y"], feeds["Z"], feeds["W"], **base)
    assert expected.dtype == np.float16
    ok, message = reference.budget_report(
        implicit, reference.gated_group_rms_norm(feeds["Y"], feeds["Z"], feeds["W"], **base, compute_dtype=np.float64)
    )
    assert ok, message
    # A real gated_dtype is a different computation: the attribute is read, not ignored.
    rounded = _kernel(_one_node({**base, "gated_dtype": BFLOAT16}), feeds)
    assert not np.array_equal(rounded, implicit)
    ok, message = reference.budget_report(
        rounded, **reference.reference_for_budget(feeds["Y"], feeds["Z"], feeds["W"], **base, gated_dtype=bfloat16)
    )
    assert ok, message


@pytest.mark.parametrize("missing", ["epsilon", "group_size"])
def test_required_attributes_are_required_by_kernel_and_reference(missing: str, library: str) -> None:
    attrs = {"epsilon": 1e-5, "group_size": 8}
    del attrs[missing]
    with pytest.raises(Exception, match=f"required attribute '{missing}'"):
        _kernel(_one_node(attrs), {})
    with pytest.raises(ValueError, match="needs the attributes epsilon and group_size"):
        reference.GatedGroupRMSNorm._run(None, np.ones((1, 8)), np.ones((1, 8)), np.ones(8), **attrs)  # type: ignore[arg-type]


def test_all_float32_output_rule(library: str) -> None:
    """Y, Z, W float32 with a half output_dtype: the output tensor is float32, values rounded to float16."""
    rng = np.random.default_rng(1)
    feeds = {
        name: rng.standard_normal(shape).astype(np.float32)
        for name, shape in (("Y", (2, 3, 16)), ("Z", (2, 3, 16)), ("W", (16,)))
    }
    out = _kernel(_one_node({"epsilon": 1e-5, "group_size": 8, "output_dtype": FLOAT16}, y_type=FLOAT), feeds)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out.astype(np.float16).astype(np.float32), out)  # exactly float16 values
    assert "when `Y`, `Z` and `W` are all float32" in _section(OP_DOC.read_text(), "Type rules")


def _formula(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if re.match(r"^(h\[j\]|m2|nf|n\[j\]|O\[j\])\s+=", stripped):
            lines.append(" ".join(stripped.split("#")[0].split()))
    return lines


def test_formula_is_the_references() -> None:
    documented = _formula(_section(OP_DOC.read_text(), "Math"))
    assert len(documented) == 5
    assert documented == _formula(reference.__doc__ or "")


def test_accuracy_constants_are_budget_reports() -> None:
    budget = _section(OP_DOC.read_text(), "Accuracy budget")
    source = inspect.getsource(reference.budget_report)
    assert "2e-6" in budget and "2e-6" in source
    assert "0.1 %" in budget and "0.001 * actual.size" in source
    assert "99.9 %" in budget
    # The allowance is rounded down (int), as the table says.
    assert "int(0.001 * actual.size)" in source and "rounded down: below 1000 elements, all" in budget
    assert reference.GATED_TIE_WINDOW == 2.0**-20 and "2⁻²⁰" in budget
    assert "reference_for_budget" in budget and hasattr(reference, "reference_for_budget")
    # The names the section uses for the consistent evaluations are the reference's.
    assert "flip_gated=mask" in budget and "flip_gated" in inspect.signature(reference.gated_group_rms_norm).parameters
    assert "`bounds`" in budget and "bounds" in inspect.signature(reference.budget_report).parameters
    assert set(reference.reference_for_budget(*_budget_feeds(), epsilon=1e-5, group_size=8)) == {"expected", "bounds"}


def _budget_feeds() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return (
        rng.standard_normal((2, 16)).astype(np.float32),
        rng.standard_normal((2, 16)).astype(np.float32),
        np.ones(16, np.float32),
    )


def test_budget_exception_at_the_overflow_threshold_is_the_references() -> None:
    """op.md: an h at float16's overflow threshold (65520) is not given the choice; a value as close to an
    ordinary tie is."""
    budget = _section(OP_DOC.read_text(), "Accuracy budget")
    assert "overflow threshold (65520" in budget
    window = reference.GATED_TIE_WINDOW
    # Just below and above 65520 (between 65504 and Inf), and just above 65488 (between 65472 and 65504).
    near = np.array([65520.0 * (1 - window / 4), 65520.0 * (1 + window / 4), 65488.0 * (1 + window / 4)])
    rounded, other, distance = reference.tie_neighbours(near, np.float16)
    assert list(distance <= window) == [False, False, True]
    assert (rounded[2], other[2]) == (65504.0, 65472.0)


# --- docs/forms.md ------------------------------------------------------------------------------------

#: The per-exporter table's first column -> the manifest's exporter names (opset 23 is the dynamo row).
EXPORTER_ROWS = {
    "torch dynamo (`optimize=True`), opset 18 / 23": "dynamo",
    "torch dynamo, `optimize=False`": "dynamo-noopt",
    "TorchScript (`dynamo=False`), opset 17 — mixer only": "torchscript",
    "transformers `OnnxExporter`, opset 20": "transformers",
    'transformers with `ort_fusions="cpu"`': "transformers-ort",
}


def test_per_exporter_table_is_what_the_exports_contain() -> None:
    documented: dict[tuple[str, str, str], str] = {}
    exporter = None
    for row in _table(_section(FORMS_DOC.read_text(), "Per exporter, as measured")):
        exporter = EXPORTER_ROWS[row[0]] if row[0] else exporter
        for dtype in (d.strip() for d in row[1].split(",")):
            documented[(exporter, dtype, "prefill")] = row[2]
            documented[(exporter, dtype, "decode")] = row[3]
    manifest = json.loads((ROOT / "tests" / "fixtures" / "models" / "manifest.json").read_text())["fixtures"]
    for stem, record in manifest.items():
        chains = record["chains"]
        (form,) = chains["forms"]
        (nodes,) = set(chains["nodes_per_chain"])
        cell = documented[(record["exporter"], record["dtype"], record["mode"])]
        assert cell == f"{form}, {nodes} nodes", f"{stem}: docs say {cell!r}, the export has {form}, {nodes} nodes"


def test_forms_are_the_classifiers() -> None:
    """Every form the rule can report is in the catalog: fused, or in the "not fused yet" table."""
    text = FORMS_DOC.read_text()
    fused = [row[0] for row in _table(_section(text, "Forms that are fused"))]
    pending = {
        letter
        for row in _table(_section(text, "Forms not fused yet (being added)"))
        for letter in re.findall(r"\b[A-Z]\b", row[0])
    }
    from fusion.rules import gated_group_rms_norm

    returned = {
        node.value.value
        for node in ast.walk(ast.parse(inspect.getsource(gated_group_rms_norm.classify)))
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant)
    }
    assert fused == sorted(fused) and set(fused) <= returned, f"docs list fused forms the rules do not have: {fused}"
    assert returned <= set(fused) | pending, f"forms the rules report but docs/forms.md does not list: {returned}"


def _message_texts() -> list[str]:
    """Return every string literal of the rule modules, f-string fields replaced by '…'."""
    texts = []
    for path in sorted((ROOT / "fusion" / "rules").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                texts.append(
                    "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)  # type: ignore[misc]
                )
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append(node.value)
    return texts


def _documented_reasons() -> list[str]:
    rows = _table(_section(FORMS_DOC.read_text(), "What is refused, and why"))
    return [reason for row in rows for reason in re.findall(r"`([^`]+)`", row[1])]


def test_every_quoted_refusal_reason_is_one_the_rules_give() -> None:
    texts = _message_texts()
    reasons = _documented_reasons()
    assert len(reasons) >= 30
    unknown = []
    for reason in reasons:
        fragments = [f.strip() for f in reason.split("…") if f.strip()]
        if not any(_in_order(fragments, text) for text in texts):
            unknown.append(reason)
    assert not unknown, f"docs/forms.md quotes reasons the rules do not give: {unknown}"


def _in_order(fragments: list[str], text: str) -> bool:
    position = 0
    for fragment in fragments:
        found = text.find(fragment, position)
        if found < 0:
            return False
        position = found + len(fragment)
    return True


# --- links --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", OUR_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_stay_inside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    assert "../shared" not in text and "DESIGN.md" not in text and "STYLE.md" not in text
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+://", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
        assert path.exists(), f"{doc.name} links to a missing file: {target}"


def test_readme_links_the_contract_and_the_catalog() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "(docs/op.md)" in readme and "(docs/forms.md)" in readme


def test_tested_by_column_names_real_tests() -> None:
    """Every "tested by" reference of the fused-forms table exists: rule test cases and test files."""
    rows = _table(_section(FORMS_DOC.read_text(), "Forms that are fused"))
    rule_tests = (ROOT / "tests" / "test_rules_gated_group_rms_norm.py").read_text()
    prefixes = [prefix for row in rows for prefix in re.findall(r"`([A-Z])_\*` cases", row[4])]
    assert prefixes == [row[0] for row in rows], prefixes  # every fused form names its rule test cases
    for row in rows:
        for prefix in re.findall(r"`([A-Z])_\*` cases", row[4]):
            assert f'"{prefix}_' in rule_tests, (
                f"form {row[0]}: no {prefix}_* case in test_rules_gated_group_rms_norm.py"
            )
        for path in re.findall(r"`(tests/[\w/]+\.py)`", row[4]):
            assert (ROOT / path).is_file(), f"form {row[0]}: {path} does not exist"


def test_mobius_table_is_what_the_builds_contain() -> None:
    rows = _table(_section(FORMS_DOC.read_text(), "Microsoft's mobius builder"))
    documented = {row[0]: row[3] for row in rows}
    manifest = json.loads((ROOT / "tests" / "fixtures" / "mobius" / "manifest.json").read_text())
    assert len(manifest["builds"]) > 0
    for build in manifest["builds"]:
        for chain in build["chains"]["details"]:
            f32_nodes, half_nodes = (int(n) for n in documented[chain["form"]].split(" / "))
            expected = f32_nodes if build["dtype"] == "f32" else half_nodes
            assert chain["nodes"] == expected, f"{build['stem']}: {chain['form']} has {chain['nodes']} nodes"


def test_families_table_is_what_the_family_exports_contain() -> None:
    rows = _table(_section(FORMS_DOC.read_text(), "Other Mamba-2 families"))
    documented = {re.search(r"\(`(\w+)`\)", row[0]).group(1): row for row in rows}  # type: ignore[union-attr]
    manifest = json.loads((ROOT / "tests" / "fixtures" / "models" / "families" / "manifest.json").read_text())
    measured: dict[str, set[tuple[str, int]]] = {}
    for record in manifest["fixtures"].values():
        pairs = measured.setdefault(record["family"], set())
        forms, nodes = record["chains"]["forms"], record["chains"]["nodes_per_chain"]
        if forms:  # one form per export, every chain the same size
            ((form,), (count,)) = (list(forms), sorted(set(nodes)))
            pairs.add((form, count))
        if record.get("expected_refusal"):
            assert record["expected_refusal"] in documented[record["family"]][2], record["family"]
    assert measured.keys() == documented.keys()
    for family, pairs in measured.items():
        cell = {(form, int(nodes)) for form, nodes in re.findall(r"\b([A-J]) (\d+)\b", documented[family][1])}
        assert cell == pairs, f"{family}: docs {sorted(cell)}, exports {sorted(pairs)}"
