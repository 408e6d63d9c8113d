"""Inputs for ``--verify`` and the report: symbolic dims bound by name, defaults that agree, seeded arrays.

A model's symbolic dims are plain names (``batch``, ``past_sequence_len``) or expressions of names that
builders write for sizes derived from others (mobius names the attention mask's length
``past_seq_len + seq_len``). ``resolve_dims`` binds every one:

1. ``--dim NAME=SIZE`` (the user's bindings), then the sizes of arrays given with ``--inputs``;
2. otherwise the size the graph pins it to (``graph_dims``: a cache concatenated with the new step's
   values, a state multiplied with a value of known shape; torch dynamo names its cache dims ``s26``,
   ``s35``, ... and nothing else tells their sizes);
3. otherwise a default by name, for one decode step: 8 for a past / cache length, 1 for batch, sequence
   and anything else, ``past + sequence`` for a ``total`` length; in a prefill graph (one that holds the
   Mamba-2 chunked scan: a ``Mod`` by a constant chunk size, which decode steps do not have) every dim but a
   batch is a sequence length and defaults to two chunks and one token (``prefill_lengths``), so that the
   scan runs over several chunks and a padded one; where the original model rejects that length (exports
   that run only up to one chunk, or only at multiples of it) ``--verify`` and the report use one chunk;
4. an expression is evaluated from the sizes of its names (parsed here, never ``eval``'d: integers,
   names, ``+ - * / // %`` and parentheses). A name used in an expression that is not itself a dim of the
   model stands for the dim whose name is the same once ``sequence`` is read as ``seq`` and ``length`` as
   ``len`` (mobius' ``past_seq_len`` is the model's ``past_sequence_len``), so a binding of one is a
   binding of both. A dim name with an operator none of whose terms is a dim of the model
   (``batch-size``) is a plain name.

A ``--dim`` for a name the model does not have, or one that contradicts what an expression gives, is an
error; so are generated inputs larger than half of this machine's memory. Arrays of ``--inputs`` that name
no input of the model (the outputs or other steps an ``.npz`` often holds too) are ignored, and the
commands say which (``split_provided``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np
import onnx

#: Default sizes for symbolic dimensions, by name: a decode step (one new token, a short cache).
DEFAULT_DIMS: dict[str, int] = {"batch": 1, "batch_size": 1, "sequence_length": 1, "seq": 1, "seq_len": 1}
DEFAULT_CACHE_LENGTH = 8
UNKNOWN_DIM = 1
#: A prefill graph's sequence length by default: this many SSD chunks and one token (the last chunk padded).
DEFAULT_PREFILL_CHUNKS = 2

#: The rules above, for the commands' --help (rewrite --verify/--report, report).
HELP = f"""\
  --inputs FILE.npz gives real arrays; every other input is generated (seeded) with its symbolic dims
  bound by --dim NAME=SIZE, else to the size the graph pins them to (a cache concatenated with a new
  step's values, a state multiplied with a value of known shape), else by name for one decode step:
  {DEFAULT_CACHE_LENGTH} for a past/cache length, past + 1 for a total length, 1 for batch, sequence and
  anything else. A prefill graph (one that holds the Mamba-2 chunked scan) is run at {DEFAULT_PREFILL_CHUNKS}
  chunks + 1 tokens instead (at one chunk where the original rejects that). A dim named by an expression
  of other dims (mobius: 'past_seq_len + seq_len') is evaluated from them (+ - * / // % and
  parentheses; past_seq_len there is the model's past_sequence_len). The dims used are printed. A --dim
  the model does not have is an error that lists the dims it has. Arrays of --inputs that name no input
  of the model are ignored, and a note names them."""


class InputError(ValueError):
    """A problem with ``--dim``, ``--inputs`` or the inputs they make, with a message for the user."""


# --- dim expressions --------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_.]*)|(//|[-+*/%()]))")


@dataclass(frozen=True)
class _Expression:
    """A parsed dim expression: ``evaluate`` with sizes for ``names``."""

    text: str
    names: tuple[str, ...]
    evaluate: Callable[[dict[str, int]], int]


def _tokens(text: str) -> list[tuple[str, str]] | None:
    tokens, position = [], 0
    while position < len(text):
        if text[position:].isspace():
            break
        match = _TOKEN.match(text, position)
        if match is None:
            return None
        number, name, operator = match.groups()
        tokens.append(("int", number) if number else ("name", name) if name else ("op", operator))
        position = match.end()
    return tokens


def parse_expression(text: str) -> _Expression | None:
    """Return ``text`` parsed as an arithmetic expression of dim names, or None when it is a plain name
    (or a number, or something that is no expression: then it is an opaque name)."""
    tokens = _tokens(text)
    if not tokens or not any(kind == "op" for kind, _ in tokens):
        return None
    position = 0
    names: list[str] = []

    def peek() -> tuple[str, str] | None:
        return tokens[position] if position < len(tokens) else None

    def take() -> tuple[str, str]:
        nonlocal position
        position += 1
        return tokens[position - 1]

    # Recursive descent: sum := product (('+'|'-') product)*; product := unary (('*'|'/'|'//'|'%') unary)*
    def parse_sum() -> Callable[[dict[str, int]], int]:
        left = parse_product()
        while peek() in (("op", "+"), ("op", "-")):
            operator, right = take()[1], parse_product()
            left = _binary(operator, left, right)
        return left

    def parse_product() -> Callable[[dict[str, int]], int]:
        left = parse_unary()
        while peek() in (("op", "*"), ("op", "/"), ("op", "//"), ("op", "%")):
            operator, right = take()[1], parse_unary()
            left = _binary(operator, left, right)
        return left

    def parse_unary() -> Callable[[dict[str, int]], int]:
        if peek() == ("op", "-"):
            take()
            inner = parse_unary()
            return lambda sizes: -inner(sizes)
        if peek() == ("op", "("):
            take()
            inner = parse_sum()
            if take() != ("op", ")"):
                raise SyntaxError
            return inner
        kind, value = take()
        if kind == "int":
            number = int(value)
            return lambda sizes: number
        if kind == "name":
            names.append(value)
            return lambda sizes: sizes[value]
        raise SyntaxError

    try:
        evaluate = parse_sum()
    except (SyntaxError, IndexError):
        return None
    if position != len(tokens):
        return None
    return _Expression(text, tuple(dict.fromkeys(names)), evaluate)


def _binary(
    operator: str, left: Callable[[dict[str, int]], int], right: Callable[[dict[str, int]], int]
) -> Callable[[dict[str, int]], int]:
    def apply(sizes: dict[str, int]) -> int:
        a, b = left(sizes), right(sizes)
        if operator == "+":
            return a + b
        if operator == "-":
            return a - b
        if operator == "*":
            return a * b
        if b == 0:
            raise ZeroDivisionError
        if operator == "%":
            return a % b
        if operator == "/" and a % b:
            raise ArithmeticError(f"{a} / {b} is not a whole number")
        return a // b

    return apply


# --- binding ----------------------------------------------------------------------------------------


def _canonical(name: str) -> str:
    """The name as compared across spellings: lower case, ``sequence`` -> ``seq``, ``length`` -> ``len``."""
    return name.lower().replace("sequence", "seq").replace("length", "len")


def _is_past(name: str) -> bool:
    lowered = name.lower()
    return "past" in lowered or "cache" in lowered


def _is_sequence(name: str) -> bool:
    canonical = _canonical(name)
    return "seq" in canonical and not _is_past(name) and "total" not in canonical


def default_dim(name: str) -> int:
    """Return the default size of a plain dim ``name`` (one decode step with a short cache)."""
    lowered = name.lower()
    if lowered in DEFAULT_DIMS:
        return DEFAULT_DIMS[lowered]
    if _is_past(name):
        return DEFAULT_CACHE_LENGTH
    if "total" in lowered:
        return DEFAULT_CACHE_LENGTH + 1  # past + one new token
    return UNKNOWN_DIM


def dim_params(model: onnx.ModelProto) -> list[str]:
    """Return the symbolic dims of ``model``'s graph inputs (initializers excluded), in order of use."""
    initializers = {t.name for t in model.graph.initializer}
    names: dict[str, None] = {}
    for value in model.graph.input:
        if value.name in initializers or not value.type.HasField("tensor_type"):
            continue
        for dim in value.type.tensor_type.shape.dim:
            if not dim.HasField("dim_value") and dim.dim_param and not dim.dim_param.strip().isdigit():
                names[dim.dim_param] = None
    return list(names)


#: Ops whose inputs broadcast against each other (numpy rules): a symbolic dim against a known size > 1.
_BROADCASTING = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Mod", "Equal", "Less", "LessOrEqual", "Greater"}
    | {"GreaterOrEqual", "And", "Or", "Xor", "PRelu", "BitShift"}
)


def graph_dims(model: onnx.ModelProto) -> dict[str, int]:
    """Return the sizes the graph pins symbolic input dims to, read from the shapes it declares.

    Exporters declare each intermediate value's shape; where a graph input's symbolic dim meets a fixed
    size — the non-concatenated axes of a ``Concat`` (a cache and the new step's values), an axis of a
    broadcasting op against a size above 1 (a state times a value of the layer's shape), a ``MatMul``'s
    inner axes — the model only runs with the dim at that size. Symbols that meet each other are one
    dim. A symbol pinned to two sizes is left out (then its default applies, and the model's own error
    says why). These sizes only choose test inputs: both models of ``--verify`` get the same arrays.
    """
    graph = model.graph
    symbols = set(dim_params(model))
    shapes: dict[str, list[int | str | None]] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            shapes[value.name] = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in value.type.tensor_type.shape.dim
            ]
    for tensor in graph.initializer:
        shapes[tensor.name] = list(tensor.dims)
    parent: dict[str, str] = {s: s for s in symbols}
    sizes: dict[str, set[int]] = {}

    def find(symbol: str) -> str:
        while parent[symbol] != symbol:
            parent[symbol] = parent[parent[symbol]]
            symbol = parent[symbol]
        return symbol

    def meet(a: int | str | None, b: int | str | None, broadcast: bool = False) -> None:
        if isinstance(a, str) and a not in symbols or isinstance(b, str) and b not in symbols:
            return  # an expression or an intermediate's own symbol: not followed
        if isinstance(a, str) and isinstance(b, str):
            parent[find(a)] = find(b)
        elif isinstance(a, str) and isinstance(b, int) and (b > 1 or not broadcast):
            sizes.setdefault(a, set()).add(b)
        elif isinstance(b, str) and isinstance(a, int) and (a > 1 or not broadcast):
            sizes.setdefault(b, set()).add(a)

    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        inputs = [shapes.get(name) for name in node.input if name]
        if node.op_type == "Concat" and all(shape is not None for shape in inputs):
            rank = len(inputs[0])  # type: ignore[arg-type]
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0) % max(rank, 1)
            for shape in inputs[1:]:
                if len(shape) == rank:  # type: ignore[arg-type]
                    for i in range(rank):
                        if i != axis:
                            meet(inputs[0][i], shape[i])  # type: ignore[index]
        elif node.op_type in _BROADCASTING and len(inputs) >= 2 and all(shape is not None for shape in inputs):
            for i, first in enumerate(inputs):
                for second in inputs[i + 1 :]:
                    for a, b in zip(reversed(first), reversed(second), strict=False):  # type: ignore[arg-type]
                        meet(a, b, broadcast=True)
        elif node.op_type == "MatMul" and len(inputs) == 2 and all(s is not None and len(s) >= 2 for s in inputs):
            meet(inputs[0][-1], inputs[1][-2])  # type: ignore[index]
    pinned: dict[str, set[int]] = {}
    for symbol, values in sizes.items():
        pinned.setdefault(find(symbol), set()).update(values)
    result = {}
    for symbol in symbols:
        values = pinned.get(find(symbol), set())
        if len(values) == 1:
            result[symbol] = next(iter(values))
    return result


def graph_minimums(model: onnx.ModelProto) -> dict[str, int]:
    """Return the least size of a symbolic input dim at which every declared shape expression of it alone is
    a size (at least 1), where that is more than 1: a dynamo export declares a convolution's output over
    the cache and the new step as ``s84 - 2``, so the cache must hold 3 (the kernel less one) or more."""
    symbols = set(dim_params(model))
    expressions: dict[str, list[_Expression]] = {}
    graph = model.graph
    for value in [*graph.value_info, *graph.output]:
        for dim in value.type.tensor_type.shape.dim if value.type.HasField("tensor_type") else []:
            if dim.HasField("dim_value") or not dim.dim_param:
                continue
            expression = parse_expression(dim.dim_param)
            if expression is not None and len(set(expression.names)) == 1 and expression.names[0] in symbols:
                expressions.setdefault(expression.names[0], []).append(expression)
    result = {}
    for symbol, found in expressions.items():
        for size in range(1, 65):
            try:
                if all(e.evaluate({symbol: size}) >= 1 for e in found):
                    break
            except (ArithmeticError, ZeroDivisionError):
                continue
        else:
            continue
        if size > 1:
            result[symbol] = size
    return result


def _format(dims: dict[str, int]) -> str:
    return ", ".join(f"{name}={size}" for name, size in dims.items())


def _int_constants(graph: onnx.GraphProto) -> dict[str, int]:
    """Return the values of ``graph`` that are one constant integer (inline initializers and Constant nodes)."""
    found: dict[str, int] = {}
    integer = {onnx.TensorProto.INT64, onnx.TensorProto.INT32}
    for tensor in graph.initializer:
        if tensor.data_type in integer and not tensor.external_data and int(np.prod(tensor.dims)) == 1:
            found[tensor.name] = int(onnx.numpy_helper.to_array(tensor).reshape(-1)[0])
    for node in graph.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or not node.output:
            continue
        for attribute in node.attribute:
            if attribute.name == "value_int":
                found[node.output[0]] = int(attribute.i)
            elif attribute.name == "value_ints" and len(attribute.ints) == 1:
                found[node.output[0]] = int(attribute.ints[0])
            elif attribute.name == "value" and attribute.t.data_type in integer and int(np.prod(attribute.t.dims)) == 1:
                found[node.output[0]] = int(onnx.numpy_helper.to_array(attribute.t).reshape(-1)[0])
    return found


def ssd_chunk_size(model: onnx.ModelProto) -> int | None:
    """Return the chunk size of the Mamba-2 chunked scan ``model`` holds (a prefill graph), or None.

    The scan pads the sequence to a multiple of the chunk size, ``(chunk - L % chunk) % chunk``: every exporter
    (torch dynamo, TorchScript, transformers') writes a ``Mod`` by the constant chunk size there. A decode step
    has no scan and no such ``Mod``; nor do mobius builds, whose one graph does prefill and decode through ONNX
    Runtime's LinearAttention (they keep the decode defaults).
    """
    constants = _int_constants(model.graph)
    sizes = {
        constants[node.input[1]]
        for node in model.graph.node
        if node.op_type == "Mod"
        and node.domain in ("", "ai.onnx")
        and len(node.input) == 2
        and constants.get(node.input[1], 0) > 1
    }
    return max(sizes) if sizes else None


def prefill_lengths(model: onnx.ModelProto) -> list[int]:
    """Return the sequence lengths to generate a prefill graph's inputs at, preferred first, or [] for a graph
    that holds no chunked scan (``ssd_chunk_size``).

    First ``DEFAULT_PREFILL_CHUNKS`` chunks and one token: the scan carries its state across chunks and pads the
    last one. Then one chunk, which the exports that do not run at that length do run: transformers' exporter
    bakes the traced number of chunks into its prefill graphs (one chunk for a short traced prompt), and a
    dynamo export traced at a multiple of the chunk size runs only at multiples of it (models/README.md,
    exporter failures 6 and 7).
    """
    chunk = ssd_chunk_size(model)
    return [] if chunk is None else [DEFAULT_PREFILL_CHUNKS * chunk + 1, chunk]


def prefill_note(
    model: onnx.ModelProto, length: int, rejected: dict[int, str] | None = None, names: Sequence[str] = ()
) -> str:
    """Return how a prefill graph's sequence length ``length`` was chosen, for the dims line of --verify and the
    report: ``prefill graph: 2 chunks of 16 + 1 by default; --dim seq=N to choose``. ``rejected``: the longer
    lengths the original model refused, with its error; ``names``: the dims that took the length."""
    chunk = ssd_chunk_size(model)
    if chunk is not None and length == DEFAULT_PREFILL_CHUNKS * chunk + 1:
        how = f"{DEFAULT_PREFILL_CHUNKS} chunks of {chunk} + 1 by default"
    elif length == chunk:
        how = f"one chunk of {chunk}"
    else:
        how = f"{length} (chunk {chunk})"
    for longer, error in (rejected or {}).items():
        how += f", as the original rejects {longer} ({error})"
    hint = " ".join(f"--dim {name}=N" for name in names) or "--dim NAME=SIZE"
    return f"prefill graph: {how}; {hint} to choose"


def resolve_dims(
    model: onnx.ModelProto,
    dims: dict[str, int] | None = None,
    provided: dict[str, np.ndarray] | None = None,
    *,
    strict: bool = False,
    prefill_length: int | None = None,
) -> dict[str, int]:
    """Return the size of every symbolic dim of ``model``'s inputs, consistent with each other.

    ``dims`` are the user's bindings, ``provided`` real input arrays (their shapes bind the dims of the
    inputs they are given for). With ``strict`` (the command line), a binding of a name the model does
    not have is an InputError that lists the names it has. An expression bound by the user must equal
    what its names give. Raises InputError for an expression that does not evaluate to a positive size.
    In a prefill graph the dims left to a default, but a batch and a past length, are ``prefill_length``
    (default: the first of ``prefill_lengths``).
    """
    return _resolve(model, dims, provided, strict=strict, prefill_length=prefill_length)[0]


def prefill_defaulted(
    model: onnx.ModelProto,
    dims: dict[str, int] | None = None,
    provided: dict[str, np.ndarray] | None = None,
    prefill_length: int | None = None,
) -> list[str]:
    """Return the dims ``resolve_dims`` gives the prefill length by default (none for a decode graph, or where
    ``--dim`` / ``--inputs`` bind every sequence dim)."""
    return _resolve(model, dims, provided, prefill_length=prefill_length)[1]


def _is_batch(name: str) -> bool:
    return "batch" in name.lower()


def _resolve(
    model: onnx.ModelProto,
    dims: dict[str, int] | None,
    provided: dict[str, np.ndarray] | None,
    *,
    strict: bool = False,
    prefill_length: int | None = None,
) -> tuple[dict[str, int], list[str]]:
    if prefill_length is None:
        prefill_length = next(iter(prefill_lengths(model)), None)
    prefilled: list[str] = []
    dims = dict(dims or {})
    params = dim_params(model)
    parsed = {name: e for name in params if (e := parse_expression(name)) is not None}
    plain = [name for name in params if name not in parsed]
    # An expression is one whose terms include a dim of the model; otherwise it is a name that happens to
    # hold an operator ("batch-size"), sized by name like any other.
    plain_canonical = {_canonical(name) for name in plain}
    expressions = {n: e for n, e in parsed.items() if any(_canonical(v) in plain_canonical for v in e.names)}
    plain += [name for name in parsed if name not in expressions]
    variables = list(dict.fromkeys(v for e in expressions.values() for v in e.names))
    known = list(dict.fromkeys([*plain, *variables, *expressions]))
    if strict:
        unknown = [name for name in dims if name not in known]
        if unknown:
            has = ", ".join(repr(n) for n in known) if known else "none: every input dim is fixed"
            raise InputError(f"--dim {unknown[0]!r}: the model has no such symbolic dim (its dims: {has})")

    bound = {name: size for name, size in dims.items() if name not in expressions}
    for name, size in _sizes_from_arrays(model, provided or {}).items():
        if name in expressions:
            continue
        bound.setdefault(name, size)
    # A term of an expression that is not a dim of the model is the dim spelled the same way
    # (past_seq_len for past_sequence_len) where exactly one is: one dim, one binding.
    alias = {}
    for term in (v for v in variables if v not in plain):
        matches = [name for name in plain if _canonical(name) == _canonical(term)]
        if len(matches) == 1:
            alias[term] = matches[0]
    for term, name in alias.items():
        if term in bound and name in bound and bound[term] != bound[name]:
            raise InputError(
                f"--dim {name}={bound[name]} and {term}={bound[term]}: these name one dim of the model; give one size"
            )
        if term in bound:
            bound.setdefault(name, bound[term])
    sizes: dict[str, int | None] = {name: bound.get(name) for name in dict.fromkeys([*plain, *variables])}
    # Sizes the graph pins (a dynamo export's s26, s35, ...), before any default by name.
    for name, size in graph_dims(model).items():
        if name in sizes and sizes[name] is None and name not in alias:
            sizes[name] = size
    # Defaults; a total length is past + sequence where the model has one of each.
    pasts = [n for n in plain if _is_past(n)]
    sequences = [n for n in plain if _is_sequence(n)]
    minimums = graph_minimums(model)
    for name in [n for n in sizes if sizes[n] is None and "total" not in n.lower() and n not in alias]:
        default = default_dim(name)
        if prefill_length is not None and not _is_batch(name) and not _is_past(name):
            default = prefill_length
            prefilled.append(name)
        sizes[name] = max(default, minimums.get(name, 1))
    for name in [n for n in sizes if sizes[n] is None and n not in alias]:
        if len(pasts) == 1 and len(sequences) == 1:
            sizes[name] = sizes[pasts[0]] + sizes[sequences[0]]  # type: ignore[operator]
        else:
            sizes[name] = default_dim(name)
    for term, name in alias.items():
        sizes[term] = sizes[name]

    result: dict[str, int] = {}
    for name in params:
        expression = expressions.get(name)
        if expression is None:
            result[name] = sizes[name]
            continue
        try:
            value = expression.evaluate(sizes)
        except (ArithmeticError, ZeroDivisionError) as error:
            detail = f": {error}" if str(error) else ""
            raise InputError(f"dim {name!r} does not evaluate with {_format(sizes)}{detail}") from None
        if name in dims and dims[name] != value:
            parts = _format({v: sizes[v] for v in expression.names})
            raise InputError(
                f"--dim {name}={dims[name]} disagrees with its terms ({parts} give {value}); "
                f"bind the terms instead: --dim {alias.get(expression.names[0], expression.names[0])}=SIZE"
            )
        if value < 1:
            raise InputError(f"dim {name!r} = {value} with {_format(sizes)}; bind its terms with --dim NAME=SIZE")
        result[name] = value
    return result, prefilled


def _sizes_from_arrays(model: onnx.ModelProto, provided: dict[str, np.ndarray]) -> dict[str, int]:
    """Return the sizes the shapes of ``provided`` arrays give the symbolic dims of their inputs."""
    sizes: dict[str, int] = {}
    for value in model.graph.input:
        array = provided.get(value.name)
        if array is None or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        if len(dims) != np.ndim(array):
            continue
        for dim, size in zip(dims, np.shape(array), strict=True):
            if not dim.HasField("dim_value") and dim.dim_param:
                sizes.setdefault(dim.dim_param, int(size))
    return sizes


def describe(dims: dict[str, int]) -> str:
    """Return ``name=size, …`` of the dims used, or ``none`` for a model whose inputs are all fixed."""
    return _format(dims) if dims else "none (fixed shapes)"


def holds_bfloat16(model: onnx.ModelProto) -> bool:
    """Return whether ``model`` declares a bfloat16 value or weight, or casts to bfloat16 (ONNX Runtime's
    CPU provider has no bfloat16 kernels for most ops)."""
    bf16 = onnx.TensorProto.BFLOAT16
    graph = model.graph
    values = [*graph.input, *graph.output, *graph.value_info]
    return (
        any(v.type.tensor_type.elem_type == bf16 for v in values)
        or any(t.data_type == bf16 for t in graph.initializer)
        or any(n.op_type == "Cast" and any(a.name == "to" and a.i == bf16 for a in n.attribute) for n in graph.node)
    )


# --- arrays -----------------------------------------------------------------------------------------


def numpy_dtype(elem_type: int) -> np.dtype:
    """Return the numpy dtype of an ONNX element type; InputError for bfloat16 (numpy has none)."""
    if elem_type == onnx.TensorProto.BFLOAT16:
        raise InputError("a model input is bfloat16, which numpy cannot make; use a float16 or float32 model")
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


def memory_limit() -> int:
    """Return the most bytes of generated inputs allowed: half of this machine's physical memory."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 64 * 2**30


def _gib(size: int) -> str:
    return f"{size / 2**30:.3g} GiB"


def _generated(model: onnx.ModelProto, provided: dict[str, np.ndarray]) -> Iterator[onnx.ValueInfoProto]:
    initializers = {init.name for init in model.graph.initializer}
    for value in model.graph.input:
        if value.name not in initializers and value.name not in provided:
            yield value


def make_inputs(
    model: onnx.ModelProto,
    dims: dict[str, int] | None = None,
    seed: int = 0,
    provided: dict[str, np.ndarray] | None = None,
    *,
    resolved: dict[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Return seeded inputs for every graph input, symbolic dimensions bound by ``resolve_dims``.

    ``provided`` arrays (real inputs, e.g. from ``load_inputs``) are used as they are. Others are made:
    integer inputs get small non-negative values (token ids < 16, masks of ones, positions counting up),
    floating inputs N(0, 1) values. ``resolved`` (from ``resolve_dims``) skips the resolution. Raises
    InputError before allocating when the generated arrays would take more than ``memory_limit()``.
    """
    provided = provided or {}
    sizes = resolved if resolved is not None else resolve_dims(model, dims, provided)
    plan: list[tuple[onnx.ValueInfoProto, list[int], np.dtype]] = []
    for value in _generated(model, provided):
        if not value.type.HasField("tensor_type"):
            raise InputError(f"input {value.name!r} is not a tensor; only tensors can be generated")
        tensor_type = value.type.tensor_type
        shape = [
            d.dim_value
            if d.HasField("dim_value")
            else sizes.get(d.dim_param, UNKNOWN_DIM)
            if not d.dim_param.strip().isdigit()
            else int(d.dim_param)
            for d in tensor_type.shape.dim
        ]
        plan.append((value, shape, numpy_dtype(tensor_type.elem_type)))
    need = {value.name: int(np.prod(shape, dtype=object)) * dtype.itemsize for value, shape, dtype in plan}
    limit = memory_limit()
    if sum(need.values()) > limit:
        largest = max(plan, key=lambda item: need[item[0].name])
        raise InputError(
            f"the generated inputs would take {_gib(sum(need.values()))} (input {largest[0].name!r} of shape "
            f"{largest[1]}: {_gib(need[largest[0].name])}) with dims {describe(sizes)}; more than half of this "
            f"machine's memory ({_gib(limit)}): choose smaller --dim sizes"
        )
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for value in (v for v in model.graph.input if v.name in provided):
        array = np.asarray(provided[value.name])
        expected = value.type.tensor_type.elem_type
        if expected and expected != onnx.TensorProto.BFLOAT16:
            array = array.astype(numpy_dtype(expected), copy=False)  # e.g. fp16 inputs saved as fp32
        feeds[value.name] = array
    for value, shape, dtype in plan:
        lowered = value.name.lower()
        if np.issubdtype(dtype, np.integer):
            if "mask" in lowered:
                array = np.ones(shape, dtype)
            elif "position" in lowered:
                array = np.broadcast_to(np.arange(shape[-1] if shape else 1, dtype=dtype), shape).copy()
            else:
                array = rng.integers(0, 16, size=shape).astype(dtype)
        elif dtype == np.bool_:
            array = np.ones(shape, dtype)
        else:
            array = rng.standard_normal(shape).astype(dtype)
        feeds[value.name] = array
    return feeds


def load_inputs(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Return the arrays of an ``.npz`` file of model inputs, keyed by input name.

    Keys may also end in ``input/<name>`` (as in tests/fixtures/models/references.npz): the part after the
    last ``input/`` is the name.
    """
    file = Path(path)
    if not file.is_file():
        raise InputError(f"inputs file {str(file)!r} does not exist")
    try:
        with np.load(file, allow_pickle=False) as data:
            return {key.rsplit("input/", 1)[-1]: data[key] for key in data.files}
    except Exception as exc:
        raise InputError(f"inputs file {str(file)!r} is not a readable .npz ({type(exc).__name__})") from None


def split_provided(
    model: onnx.ModelProto, provided: dict[str, np.ndarray] | None
) -> tuple[dict[str, np.ndarray] | None, list[str]]:
    """Return the arrays of ``provided`` that are inputs of ``model``, and the names of the others (ignored).

    An ``.npz`` of real inputs often holds more (a step's outputs, the arrays of other steps); those are not
    an error. A misspelt input name shows as an ignored array (``ignored_note``) and as a generated input in
    --verify's "inputs:" line. An ``.npz`` none of whose arrays is an input of the model is an InputError: it
    is another model's, or every name is misspelt, and nothing of it would be used.
    """
    if provided is None:
        return None, []
    initializers = {t.name for t in model.graph.initializer}
    names = [v.name for v in model.graph.input if v.name not in initializers]
    used = {name: array for name, array in provided.items() if name in names}
    ignored = sorted(name for name in provided if name not in names)
    if ignored and not used:
        shown = ", ".join(repr(name) for name in ignored[:5]) + (" ..." if len(ignored) > 5 else "")
        raise InputError(
            f"--inputs: none of its arrays ({shown}) is an input of the model (its inputs: {', '.join(names)}): "
            "inputs of another model, or misspelt names"
        )
    return used, ignored


RunT = TypeVar("RunT")


@dataclass
class FirstRun(Generic[RunT]):
    """The original model's first accepted run (``first_run``): what ``run`` returned, the feeds and dims it ran
    on, and for a prefill graph how its sequence length was chosen (``prefill_note``), else None."""

    result: RunT
    feeds: dict[str, np.ndarray]
    dims: dict[str, int]
    note: str | None


class RejectedRun(Exception):
    """The original model rejected its inputs at every length tried: ``error`` the last rejection, ``dims`` the
    dims it ran with."""

    def __init__(self, error: BaseException, dims: dict[str, int]) -> None:
        super().__init__(str(error))
        self.error, self.dims = error, dims


def first_run(
    model: onnx.ModelProto,
    dims: dict[str, int] | None,
    provided: dict[str, np.ndarray] | None,
    run: Callable[[dict[str, np.ndarray]], RunT],
) -> FirstRun[RunT]:
    """Run the original ``model`` (``run(feeds)``) on generated inputs; a prefill graph at each of its default
    lengths (``prefill_lengths``) until one is accepted, a length the user bound at that length only.

    Raises InputError for inputs that cannot be made, RejectedRun where the model rejects the last length tried.
    """
    lengths: list[int | None] = [*prefill_lengths(model)] or [None]
    rejected: dict[int, str] = {}
    for index, length in enumerate(lengths):
        used = resolve_dims(model, dims, provided, prefill_length=length)
        prefilled = prefill_defaulted(model, dims, provided, prefill_length=length)
        feeds = make_inputs(model, provided=provided, resolved=used)
        try:
            result = run(feeds)
        except Exception as error:
            if prefilled and length is not None and index + 1 < len(lengths):
                rejected[length] = run_error(error)
                continue
            raise RejectedRun(error, used) from error
        note = prefill_note(model, length, rejected, prefilled) if prefilled and length is not None else None
        return FirstRun(result, feeds, used, note)
    raise AssertionError("unreachable: the last length returns or raises")


def run_error(error: BaseException) -> str:
    """Return the reason in ONNX Runtime's error for a run, short enough for a note: the node's op type and its
    status message without the source location (``Reshape: The input tensor cannot be reshaped ...``)."""
    text = " ".join(str(error).split()) or type(error).__name__
    node = re.search(r"while running (\w+) node", text)
    reason = text.rsplit("Status Message: ", 1)[-1]
    # "/onnxruntime_src/.../reshape_helper.h:84 onnxruntime::ReshapeHelper::ReshapeHelper(...) <condition> was
    # false. The input tensor ..." -> the sentence after the failed condition.
    reason = re.sub(r"^/\S+:\d+ .*? was false\. ", "", reason)
    reason = re.sub(r"^/\S+:\d+ \S+\(.*?\) ", "", reason)
    reason = f"{node.group(1)}: {reason}" if node else reason
    return reason if len(reason) <= 160 else reason[:157] + "..."


def ignored_note(ignored: list[str], model: onnx.ModelProto) -> str | None:
    """Return the note that says which --inputs arrays name no input of ``model`` (None when none do)."""
    if not ignored:
        return None
    shown = ", ".join(repr(name) for name in ignored[:5]) + (
        f" and {len(ignored) - 5} more" if len(ignored) > 5 else ""
    )
    initializers = {t.name for t in model.graph.initializer}
    inputs = ", ".join(v.name for v in model.graph.input if v.name not in initializers)
    return f"--inputs: ignored {len(ignored)} array(s) that name no input of the model: {shown} (its inputs: {inputs})"


def parse_dims(items: Sequence[str]) -> dict[str, int]:
    """Return {name: size} from ``NAME=SIZE`` strings (NAME may hold ``=``: the last one splits)."""
    dims = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        name = name.strip()
        if not sep or not name or not value.strip().isdigit() or int(value) < 1:
            raise InputError(f"--dim expects NAME=SIZE (a positive integer), got {item!r}")
        dims[name] = int(value)
    return dims
