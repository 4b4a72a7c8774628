"""Off-policy objectives beyond the decoupled PPO default, shipped as opt-in plugins.

Each module here is an ordinary third-party-style plugin (an ``areal_plugins`` entry point that
implements ``areal_make_policy_loss``). Installing areal_plugins does not switch them on: they declare
``AREAL_PLUGIN_OPT_IN = True`` and load only when named in ``areal.plugins.include``.
"""
