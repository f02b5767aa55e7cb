"""The text the builds are calibrated and judged on: the corpora (``corpus``: Jane
Austen's novels; ``genres``: the five-genre mix), the calibration and held-out token
sets drawn from them (``calibration``) and the fixed chat prompts (``prompts``)."""
