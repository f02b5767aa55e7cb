"""Fidelity figures: held-out perplexity and greedy continuations of a PyTorch model
(``evaluate``), and the per-genre increases and headline every record reports
(``fidelity``)."""
