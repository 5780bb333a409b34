"""Recipes: short, readable training loops over the client's calls.

The default recipe (``arctic-platform train``) runs a short SFT warm-up and then GRPO on a task a
tiny model can learn on a CPU; ``gsm8k_grpo.yaml`` runs the same loop on GSM8K for a real model.
"""
