"""Replay of a recorded asynchronous run (``areal.replay.run_dir``), one package: the recorded schedule, the conductor
actor, the driver's side and the agent loop's side (a client that follows the record). The command that starts one,
``areal-plugins replay RUN_DIR``, is :mod:`areal_plugins.cli.replay`."""
