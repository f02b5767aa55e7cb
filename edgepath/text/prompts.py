"""The fixed prompts every fidelity comparison uses (engine check, benchmarks).

Twelve chat turns of the kinds an instruct model of this size is used for;
rendered through the model's own chat template with the generation prompt.
"""

from __future__ import annotations

FIXED_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "Give me three tips for a good night's sleep.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Summarise the plot of Pride and Prejudice in one paragraph.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Suggest a name for a small bakery.",
    "What are the primary colours?",
    "Describe a cat to someone who has never seen one.",
)


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True, return_dict=False)
    return list(ids)


def fixed_prompt_ids(tokenizer) -> list[list[int]]:
    return [chat_prompt_ids(tokenizer, p) for p in FIXED_PROMPTS]
