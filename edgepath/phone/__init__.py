"""The phone builds' algorithms, one module per program kind (``qnn_w8a16``,
``xnnpack``), over the traced reference (``graph``) and the logit
comparison (``parity``). The export stage (``edgepath.stages.export``) drives them."""
