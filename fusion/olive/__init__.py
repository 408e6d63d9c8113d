"""Olive integration: a surgeon for Olive's ``GraphSurgeries`` pass that fuses gated group-RMSNorm chains.

Olive has no plugin entry points: its ``Surgeon`` base class registers every subclass (under the class
name, case-insensitive) when the class is created. Importing this module therefore makes the surgeon
``MambafuseGatedGroupRMSNorm`` available to every workflow run in the same Python process::

    import fusion.olive                     # registers the surgeon
    from olive.workflows import run

    run({
        "input_model": {"type": "HfModel", "model_path": "path/to/hf_model"},
        "passes": {
            "build": {"type": "MobiusBuilder", "precision": "fp32"},
            "fuse": {"type": "GraphSurgeries", "surgeries": [{"surgeon": "MambafuseGatedGroupRMSNorm"}]},
        },
        "output_dir": "out",
    })

``olive run --config …`` on the command line does not import it; ``mambafuse olive CONFIG.json``
(fusion/olive_command.py, which checks its arguments before Olive's slow import) does the same run with
the surgeon registered.

Evaluation inside Olive: Olive's own ONNX Runtime sessions register no custom-op library but
onnxruntime-extensions', so they cannot load mambafuse's kernels. The surgeon therefore attaches the
op's model-local function (``function=True``, the default): ONNX Runtime inlines the fused node's
stock-op body and Olive's evaluators and its ``is_valid_ep`` check run the fused model with the same
math (docs/op.md). Latency measured inside Olive is that of the body, not of the kernel; measure the
kernel with ``mambafuse report`` or a session from ``contrib_ops.session``.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

try:
    from olive.passes.onnx.graph_surgeries import Surgeon
except ImportError as error:
    raise ImportError(f"fusion.olive needs olive-ai: pip install 'mambafuse[olive]' ({error})") from error

from fusion.rewrite import Report, opt_in_fusions, rewrite_model

# A child of the "olive" logger, so that the surgeon's lines appear where Olive shows its own.
logger = logging.getLogger("olive.passes.mambafuse")

#: The name to use in a GraphSurgeries ``surgeries`` entry (Olive matches it case-insensitively).
SURGEON = "MambafuseGatedGroupRMSNorm"


class MambafuseGatedGroupRMSNorm(Surgeon):
    """Fuse every gated group-RMSNorm chain into ``ai.mambafuse::GatedGroupRMSNorm``.

    Args (the keys of the ``surgeries`` entry besides ``surgeon``):
        function: attach the op's model-local function (default True). Leave it on for any model that
            Olive evaluates or that runs without the mambafuse library.
        min_fused: fail the pass when fewer chains are fused (default 0: a model without chains passes
            through unchanged). Set it to the number of Mamba layers to catch an export whose chains the
            rewriter does not know.
        opt_in: names of opt-in fusions to run as well (``mambafuse rewrite --opt-in``'s choices, e.g.
            ``["decode_matmul_nbits"]`` after an int4 quantization pass; default none).
    """

    def __init__(self, function: bool = True, min_fused: int = 0, opt_in: list[str] | None = None) -> None:
        super().__init__()
        if not isinstance(function, bool):
            raise ValueError(f"{SURGEON}: 'function' must be true or false, got {function!r}")
        if not isinstance(min_fused, int) or isinstance(min_fused, bool) or min_fused < 0:
            raise ValueError(f"{SURGEON}: 'min_fused' must be a non-negative integer, got {min_fused!r}")
        names = [opt_in] if isinstance(opt_in, str) else opt_in if opt_in is not None else []
        if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
            raise ValueError(f"{SURGEON}: 'opt_in' must be a list of fusion names, got {opt_in!r}")
        try:
            opt_in_fusions(names)
        except ValueError as error:
            raise ValueError(f"{SURGEON}: 'opt_in': {error}") from None
        self.function = function
        self.min_fused = min_fused
        self.opt_in = list(names)
        #: The report of the last model this surgeon rewrote.
        self.report: Report | None = None

    def call_ir(self, model: ir.Model) -> ir.Model:
        model, report = rewrite_model(model, function=self.function, opt_in=self.opt_in)
        self.report = report
        for line in report.summary().splitlines():
            logger.info("%s: %s", SURGEON, line)
        if report.fused < self.min_fused:
            reasons = "; ".join(f"{where}: {reason}" for where, reason in report.refused) or "no chain found"
            raise ValueError(f"{SURGEON}: fused {report.fused} chains, min_fused is {self.min_fused} ({reasons})")
        return model
