"""Export the models of ``models.build`` (every family) to ONNX with every exporter the chain catalog knows.

Exporters (``EXPORTERS``):

- ``dynamo``        ``torch.onnx.export(..., dynamo=True, optimize=True)``, opset 18 (default) or 23.
- ``dynamo-noopt``  the same with ``optimize=False`` (docs/forms.md form D).
- ``torchscript``   ``torch.onnx.export(..., dynamo=False)``, opset 17. The whole causal LM does not
                    export there (``models.fixtures.PROBES``), so the Mamba-2 mixer of layer 0 is exported alone.
- ``torchscript-model`` the same exporter on the whole causal LM (prefill: token ids in, logits out). It
                    fails for most families (``aten::diff``, see ``models.fixtures``); Mamba2 and
                    GraniteMoeHybrid export.
- ``transformers``  transformers 5.x's own exporter, ``transformers.exporters.OnnxExporter`` (prefill and
                    decode components captured from ``generate()``).
- ``transformers-ort`` the same with ``OnnxConfig(ort_fusions="cpu")`` (form F).

Options: ``chunk_size`` replaces the config's SSD chunk size and ``prompt_len`` the traced length (a prefill's
ids, a decode cache's prompt). ``batch`` (decode only) traces the step at that many rows; above 1 the graph's
batch axis is symbolic (dynamo: ``Dim("batch")`` on the token ids, which torch.export carries to the cache;
transformers' exporter: its own dynamic axes). A dynamo prefill traced at a multiple of the chunk size runs
only at multiples of it (the chunked scan's ``[:, :seq_len]`` is not traced; see
``models.fixtures.PADDED_FIXTURES``), and writes its group count from the padded length.

Modes: ``prefill`` (token ids in, logits out, no cache) and ``decode`` (one token plus the cache in,
logits plus the updated cache out). Decode graphs name their cache ``past.<i>`` / ``present.<i>`` (our
dynamo exports) or ``input.cache.*`` / ``output.cache.*`` (transformers' exporter); ``ExportRecord.cache_map``
says which output feeds which input on the next step.

Every file is written atomically (temporary file in the same directory, then ``os.replace``) with the
weights inline, so a fixture is one self-contained ``.onnx``.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import sys
from pathlib import Path
from typing import Any

import onnx

from models.build import (
    CONFIGS,
    DTYPES,
    FAMILIES,
    FAMILY_SPECS,
    SIZES,
    build_model,
    expected_fused,
    mamba_mixers,
    num_mamba_layers,
    sample_input_ids,
)
from models.onnx_utils import (
    EXTERNAL_DATA_THRESHOLD,
    check,
    model_opset,
    repair_negative_transpose_perm,
    save_atomic,
    strip_debug_metadata,
)

EXPORTERS = ("dynamo", "dynamo-noopt", "torchscript", "torchscript-model", "transformers", "transformers-ort")
MODES = ("prefill", "decode")
DEFAULT_OPSET = {
    "dynamo": 18,
    "dynamo-noopt": 18,
    "torchscript": 17,
    "torchscript-model": 17,
    "transformers": None,
    "transformers-ort": None,
}

#: Prompt length of prefill exports and of the prompt that fills a decode export's sample cache.
#: 8 is not a multiple of the tiny chunk size (16), so the chunked scan's padding path is traced.
PROMPT_LEN = 8


class ExportUnsupported(RuntimeError):
    """An exporter cannot produce this combination (the message says why, with the exact error)."""


@dataclasses.dataclass
class ExportRecord:
    """What one export produced: the file, how it was made, and how to drive it."""

    path: str
    family: str
    exporter: str
    dtype: str
    mode: str
    opset: int
    size: str
    num_mamba_layers: int
    scope: str  # "model" (whole causal LM) or "mixer" (one Mamba-2 mixer, TorchScript)
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    cache_map: dict[str, str]  # decode: output name -> input name it feeds on the next step
    repairs: list[str]
    checker: str  # "ok", or why onnx.checker rejects a graph that ONNX Runtime runs (see ``check``)
    versions: dict[str, str]
    #: The gated norm's order ("gate_before_norm" / "norm_before_gate", ``FamilySpec.norm_order``), how many
    #: chains the rewriter must fuse (every one, or none for norm-before-gate) and, when it must refuse
    #: them, the kind of reason ("norm_before_gate"). Defaults keep older manifests' records loadable.
    norm_order: str = "gate_before_norm"
    expected_fused: int | None = None
    expected_refusal: str | None = None
    #: The SSD chunk size where it is not the config's, and the traced length (None in older manifests).
    chunk_size: int | None = None
    prompt_len: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Return the record as a JSON-ready dict."""
        return dataclasses.asdict(self)


def versions() -> dict[str, str]:
    """Return the versions of the packages that shape an export."""
    import onnxscript
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
    }


def _value_info(value: onnx.ValueInfoProto) -> dict[str, Any]:
    tensor_type = value.type.tensor_type
    shape = [d.dim_param if d.HasField("dim_param") else d.dim_value for d in tensor_type.shape.dim]
    return {
        "name": value.name,
        "dtype": onnx.TensorProto.DataType.Name(tensor_type.elem_type),
        "shape": shape,
    }


# ----------------------------------------------------------------------------------------------------
# Sample inputs


def prefill_inputs(model: Any, seq_len: int = PROMPT_LEN) -> dict[str, Any]:
    """Return the seeded prefill inputs (``input_ids [1, seq_len]``)."""
    return {"input_ids": sample_input_ids(model.config, seq_len)}


def decode_inputs(model: Any, prompt_len: int = PROMPT_LEN, batch: int = 1) -> dict[str, Any]:
    """Return decode-step inputs captured from ``generate()``: the next token, its position, the filled cache.

    transformers' own capture (``decompose_for_generation``) is used for every exporter, so dynamo and
    transformers' exporter trace the same step with the same cache object.
    """
    import torch
    from transformers.exporters.utils import decompose_for_generation

    ids = sample_input_ids(model.config, prompt_len, batch=batch)
    stages = decompose_for_generation(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    _, inputs = stages["decode"]
    return dict(inputs)


def cache_leaf_names(cache: Any) -> list[str]:
    """Return a name per tensor of ``cache`` in pytree-flatten order, e.g. ``layers.0.conv_states.0``.

    The names follow the attribute path inside transformers' cache objects (the same path its own
    exporter uses for ``input.cache.*``), so a decode graph's cache inputs say what they hold.
    """
    from transformers.exporters.exporter_dynamo import _pytree_flatten

    tensors, context = _pytree_flatten(cache)
    names: dict[int, str] = {}

    def walk(ctx: Any, path: list[str]) -> None:
        if isinstance(ctx, dict):
            tag = ctx.get("_t")
            if tag == "tensor":
                names[ctx["i"]] = ".".join(path)
            elif tag == "obj":
                walk(ctx["s"], path)
            elif tag == "items":
                for key, value in ctx["v"]:
                    walk(value, [*path, str(key)])
            elif tag in ("seq", "map"):
                walk(ctx["v"], path)
            elif tag is None:
                for key, value in ctx.items():
                    walk(value, [*path, str(key)])
        elif isinstance(ctx, list):
            for index, value in enumerate(ctx):
                walk(value, [*path, str(index)])

    walk(context, [])
    if sorted(names) != list(range(len(tensors))):
        raise RuntimeError(f"could not name every cache tensor: {len(names)} names for {len(tensors)} tensors")
    return [names[i] for i in range(len(tensors))]


# ----------------------------------------------------------------------------------------------------
# Exporters


def _prefill_wrapper(model: Any) -> Any:
    import torch

    class PrefillLogits(torch.nn.Module):
        def __init__(self, lm: Any) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=input_ids, use_cache=False).logits

    return PrefillLogits(model).eval()


def _decode_wrapper(model: Any) -> Any:
    import torch

    class DecodeStep(torch.nn.Module):
        def __init__(self, lm: Any) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, cache: Any = None) -> Any:
            # Mamba2ForCausalLM takes no position ids (no attention, no rotary embedding).
            extra = {} if position_ids is None else {"position_ids": position_ids}
            out = self.lm(input_ids=input_ids, cache=cache, use_cache=True, **extra)
            return out.logits, out.cache

    return DecodeStep(model).eval()


def _export_dynamo(
    model: Any, mode: str, opset: int, optimize: bool, prompt_len: int = PROMPT_LEN, batch: int = 1
) -> tuple[onnx.ModelProto, dict[str, str]]:
    import torch
    from transformers.exporters.exporter_dynamo import (
        get_auto_dynamic_shapes,
        register_cache_pytrees_for_model,
    )

    if mode == "prefill":
        # Dynamic sequence axis, batch fixed at 1: a dynamic batch as well fails in torch.export
        # (see models.fixtures.PROBES).
        inputs = prefill_inputs(model, prompt_len)
        program = torch.onnx.export(
            _prefill_wrapper(model),
            (inputs["input_ids"],),
            dynamo=True,
            opset_version=opset,
            optimize=optimize,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_shapes={"input_ids": {1: torch.export.Dim("seq")}},
            verbose=False,
        )
        return program.model_proto, {}

    inputs = decode_inputs(model, prompt_len, batch)
    register_cache_pytrees_for_model(model)
    cache = inputs["cache"]
    leaf_names = cache_leaf_names(cache)
    names_in = [f"past.{name}" for name in leaf_names]
    names_out = [f"present.{name}" for name in leaf_names]
    # Every cache axis Dim.AUTO (as transformers' exporter does): the key/value sequence axis grows by one
    # per step, and torch.export specializes the axes that are really fixed.
    # Inputs in the wrapper's signature order: input_ids, position_ids (not for Mamba2), the cache leaves.
    kwargs: dict[str, Any] = {"input_ids": inputs["input_ids"]}
    if "position_ids" in inputs:
        kwargs["position_ids"] = inputs["position_ids"]
    kwargs["cache"] = cache
    dynamic_shapes = {name: None for name in kwargs} | {"cache": get_auto_dynamic_shapes(cache)}
    if batch > 1:
        # A symbolic batch: the step's rows; torch.export finds the cache's batch axes equal to it.
        rows = torch.export.Dim("batch", min=1, max=4096)
        dynamic_shapes |= {name: {0: rows} for name in kwargs if name != "cache"}
    step_names = [name for name in kwargs if name != "cache"]
    program = torch.onnx.export(
        _decode_wrapper(model),
        (),
        kwargs=kwargs,
        dynamo=True,
        opset_version=opset,
        optimize=optimize,
        input_names=[*step_names, *names_in],
        output_names=["logits", *names_out],
        dynamic_shapes=dynamic_shapes,
        verbose=False,
    )
    return program.model_proto, dict(zip(names_out, names_in, strict=True))


def _export_torchscript(model: Any, mode: str, opset: int, prompt_len: int = PROMPT_LEN) -> onnx.ModelProto:
    import torch

    if mode != "prefill":
        raise ExportUnsupported(
            "torchscript decode: not exported. The mixer's decode path takes a transformers Cache object "
            "and updates its tensors in place (conv_state.copy_); a TorchScript export cannot take one."
        )

    class MixerPrefill(torch.nn.Module):
        def __init__(self, mixer: torch.nn.Module) -> None:
            super().__init__()
            self.mixer = mixer

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return self.mixer(hidden_states)

    mixer = mamba_mixers(model)[0]
    dtype = next(mixer.parameters()).dtype
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, prompt_len, model.config.hidden_size, generator=generator).to(dtype)
    buffer = io.BytesIO()
    torch.onnx.export(
        MixerPrefill(mixer).eval(),
        (hidden,),
        buffer,
        dynamo=False,
        opset_version=opset,
        input_names=["hidden_states"],
        output_names=["mixer_out"],
        dynamic_axes={"hidden_states": {1: "seq"}, "mixer_out": {1: "seq"}},
    )
    return onnx.load_from_string(buffer.getvalue())


def _export_torchscript_model(model: Any, mode: str, opset: int, prompt_len: int = PROMPT_LEN) -> onnx.ModelProto:
    """TorchScript export of the whole causal LM's prefill (token ids -> logits; no cache crosses)."""
    import torch

    if mode != "prefill":
        raise ExportUnsupported(
            "torchscript-model decode: not exported. A decode step takes a transformers Cache object, "
            "which a TorchScript export cannot take as an input."
        )
    buffer = io.BytesIO()
    torch.onnx.export(
        _prefill_wrapper(model),
        (prefill_inputs(model, prompt_len)["input_ids"],),
        buffer,
        dynamo=False,
        opset_version=opset,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_axes={"input_ids": {1: "seq"}, "logits": {1: "seq"}},
    )
    return onnx.load_from_string(buffer.getvalue())


def _export_transformers(
    model: Any, mode: str, opset: int | None, ort_fusions: str | None, prompt_len: int = PROMPT_LEN, batch: int = 1
) -> tuple[onnx.ModelProto, dict[str, str]]:
    import onnx_ir
    import torch
    from transformers.exporters import OnnxConfig, OnnxExporter
    from transformers.exporters.utils import decompose_for_generation

    ids = sample_input_ids(model.config, prompt_len, batch=batch)
    stages = decompose_for_generation(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    submodel, inputs = stages[mode]
    config = OnnxConfig(dynamic=True, opset_version=opset, ort_fusions=ort_fusions)
    exported = OnnxExporter().export(submodel, inputs, config)
    proto = onnx_ir.to_proto(exported.program)
    cache_map = {}
    if mode == "decode":
        inputs_by_name = {i.name for i in proto.graph.input}
        for out in proto.graph.output:
            if out.name.startswith("output.cache."):
                past = "input.cache." + out.name.removeprefix("output.cache.")
                if past in inputs_by_name:
                    cache_map[out.name] = past
    return proto, cache_map


def export_model(
    family: str,
    exporter: str,
    dtype: str = "fp32",
    mode: str = "prefill",
    opset: int | None = None,
    size: str = "tiny",
    out: str | os.PathLike = "model.onnx",
    strip_metadata: bool = False,
    seed: int = 0,
    chunk_size: int | None = None,
    prompt_len: int = PROMPT_LEN,
    batch: int = 1,
) -> ExportRecord:
    """Export one (family, exporter, dtype, mode) combination to ``out``; return its ``ExportRecord``.

    ``chunk_size`` replaces the config's SSD chunk size, ``prompt_len`` the traced length, ``batch`` the
    decode step's traced rows (above 1: a symbolic batch axis).
    Raises ``ExportUnsupported`` when the exporter cannot produce the combination.
    """
    for name, value, choices in (
        ("family", family, FAMILIES),
        ("exporter", exporter, EXPORTERS),
        ("dtype", dtype, tuple(DTYPES)),
        ("mode", mode, MODES),
        ("size", size, tuple(CONFIGS.get(family, SIZES))),
    ):
        if value not in choices:
            raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")
    if opset is None:
        opset = DEFAULT_OPSET[exporter]
    if prompt_len < 1:
        raise ValueError(f"prompt length {prompt_len} is not positive")
    if batch < 1 or (batch > 1 and (mode != "decode" or exporter not in ("dynamo", "dynamo-noopt", "transformers"))):
        raise ValueError(f"batch {batch}: a traced batch above 1 is for dynamo or transformers decode exports")

    import torch

    model = build_model(family, size, dtype, seed=seed, chunk_size=chunk_size)
    cache_map: dict[str, str] = {}
    scope = "model"
    with torch.no_grad():
        if exporter in ("dynamo", "dynamo-noopt"):
            proto, cache_map = _export_dynamo(model, mode, opset, exporter == "dynamo", prompt_len, batch)
        elif exporter == "torchscript":
            proto = _export_torchscript(model, mode, opset, prompt_len)
            scope = "mixer"
        elif exporter == "torchscript-model":
            proto = _export_torchscript_model(model, mode, opset, prompt_len)
        else:
            fusions = "cpu" if exporter == "transformers-ort" else None
            proto, cache_map = _export_transformers(model, mode, opset, fusions, prompt_len, batch)

    repairs = repair_negative_transpose_perm(proto)
    if strip_metadata:
        strip_debug_metadata(proto)
    external = sum(len(t.raw_data) for t in proto.graph.initializer) > EXTERNAL_DATA_THRESHOLD
    checker = "ok" if external else check(proto)
    save_atomic(proto, out)
    if external:
        # The in-memory checker serializes the model, which protobuf refuses past 2 GiB.
        checker = check(str(out))
    layers = 1 if scope == "mixer" else num_mamba_layers(family, size)
    norm_order = FAMILY_SPECS[family].norm_order
    return ExportRecord(
        path=str(out),
        family=family,
        exporter=exporter,
        dtype=dtype,
        mode=mode,
        opset=model_opset(proto),
        size=size,
        num_mamba_layers=layers,
        scope=scope,
        inputs=[_value_info(v) for v in proto.graph.input],
        outputs=[_value_info(v) for v in proto.graph.output],
        cache_map=cache_map,
        repairs=repairs,
        checker=checker,
        versions=versions(),
        norm_order=norm_order,
        expected_fused=expected_fused(family, layers),
        expected_refusal=None if norm_order == "gate_before_norm" else norm_order,
        chunk_size=chunk_size,
        prompt_len=prompt_len,
    )


def _size_on_disk(path: Path) -> int:
    data = path.with_name(f"{path.name}.data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def main(argv: list[str] | None = None) -> int:
    """Export one model from the command line; exit non-zero with one line on failure."""
    parser = argparse.ArgumentParser(prog="python -m models.export", description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--exporter", choices=EXPORTERS, required=True)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--mode", choices=MODES, default="prefill")
    parser.add_argument("--opset", type=int, default=None, help="default: 18 dynamo, 17 torchscript, exporter's own")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--chunk-size", type=int, default=None, help="the SSD chunk size (default: the config's)")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="the traced length (default: %(default)s)")
    parser.add_argument(
        "--batch", type=int, default=1, help="decode: the traced rows; above 1 a symbolic batch (default: 1)"
    )
    parser.add_argument("--strip-metadata", action="store_true", help="drop exporter stack traces (smaller file)")
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args(argv)
    for name, value in (("--chunk-size", args.chunk_size), ("--prompt-len", args.prompt_len), ("--batch", args.batch)):
        if value is not None and value < 1:
            parser.error(f"{name} must be positive, not {value}")
    try:
        record = export_model(
            args.family,
            args.exporter,
            args.dtype,
            args.mode,
            args.opset,
            args.size,
            args.output,
            strip_metadata=args.strip_metadata,
            chunk_size=args.chunk_size,
            prompt_len=args.prompt_len,
            batch=args.batch,
        )
    except ExportUnsupported as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # an exporter failure: one line, the exception's own first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: {args.exporter} export failed: {type(e).__name__}: {first}", file=sys.stderr)
        return 1
    print(
        f"wrote {record.path}: {record.family} {record.exporter} {record.dtype} {record.mode} "
        f"opset {record.opset}, "
        f"{record.num_mamba_layers} Mamba layer(s), {_size_on_disk(Path(record.path)) / 1024:.0f} KiB"
        + (f", repaired: {'; '.join(record.repairs)}" if record.repairs else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
