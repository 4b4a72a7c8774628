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


def stock_recipe() -> str:
    """A recipe shaped as verl's example scripts are: verl's ``ppo_trainer`` and our CPU body, which sets only what
    the task, the tiny model and the CPU need and leaves every other key, the trainer engine
    (``actor_rollout_ref.actor.strategy``, verl's default ``fsdp``) included, to verl. No ``areal`` node and no
    ``areal`` config group: areal_plugins comes in by ``+areal.enable=true`` on the command line
    (``_cpu_grpo_tiny.yaml`` must sit beside it)."""
    return """
hydra:
  searchpath: [pkg://verl.trainer.config]
defaults: [ppo_trainer, _cpu_grpo_tiny, _self_]
"""
