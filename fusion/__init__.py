"""mambafuse's graph side: find the chains a Mamba-2 mixer becomes in an ONNX export and fuse each into one
``ai.mambafuse`` node that carries its stock-op body as a model-local function.

The ops: ``GatedGroupRMSNorm``, ``CausalConv1dUpdate``, ``SelectiveStateUpdate`` (one entry each in the registry,
``fusion.rules.registry.FUSIONS``). Layers, bottom up: the shape proofs (``fusion.shapes``) and the op references
(``fusion.reference``); the rules and the registry (``fusion.rules``) and the function bodies (``fusion.function``);
the orchestration (``fusion.rewrite``, ``fusion.optimize``, ``fusion.report``, ``fusion.verify``, the command line
``fusion.cli``, ``fusion.genai``, ``fusion.olive``).
"""
