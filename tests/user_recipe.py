"""A verl user's own recipe, as the tests use it: verl's ``ppo_trainer`` and our CPU body, with an ``areal``
node but without our ``areal`` config group (so only the startup routing can turn areal_plugins on)."""

from __future__ import annotations


def user_recipe(mode: str = "async") -> str:
    """The recipe's YAML (``_cpu_grpo_tiny.yaml`` must sit beside it)."""
    return f"""
hydra:
  searchpath: [pkg://verl.trainer.config]
defaults: [ppo_trainer, _cpu_grpo_tiny, _self_]
areal:
  enable: true
  mode: {mode}
  plugins: {{include: null, exclude: []}}
  reward: {{service: false}}
"""
