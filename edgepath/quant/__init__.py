"""GPTQ on a 4-bit grid with its per-group scale search (``gptq``), the layer-by-layer
driver over a decoder (``sequential``), and the W4A8 activation-error ranking
(``activation_error``). The quantize and export stages run them, on calibration
windows from ``edgepath.text.calibration``, and write what they produce through
``edgepath.formats``."""
