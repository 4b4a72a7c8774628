"""Refuse a bad recipe before anything starts, in one line that names the key to change.

``areal-plugins train`` composes the recipe exactly as verl's ``main_ppo`` will (Hydra, the recipe's
folder as config path, the same overrides) and runs every check that does not need Ray or a device:
Hydra's own (a misspelled key, an unreadable override, a missing config), our ``areal:`` settings and
their routing into verl's keys, verl's ``validate_config``, and every plugin's ``areal_validate_config``
(the backend capability check among them). A failure becomes a :class:`RecipeRefusedError`: one line, no traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from areal_plugins.config.errors import RecipeRefusedError

#: omegaconf's message for a key its struct-mode node does not have.
_NOT_IN_STRUCT = re.compile(r"Key '([^']+)' is not in struct\s+full_key: (\S+)")


def check_recipe(recipe: Path, overrides: list[str], supplied: Callable[[Any], list[str]] | None = None) -> Any:
    """Compose ``recipe`` with ``overrides`` and run every startup check; return the resolved config.

    ``supplied``: the overrides the CLI puts before the user's for a recipe composed so (the CPU platform's vLLM
    settings), so the checks see what the run will get.

    Raises:
        RecipeRefusedError: the first check that fails, as one line naming the key and what to set.
    """
    from areal_plugins._compat import UnsupportedVerlVersionError, check_verl_version

    if not recipe.is_file():
        shipped = Path(__file__).resolve().parents[2] / "recipes"
        raise RecipeRefusedError(f"recipe {recipe} does not exist; pass a recipe YAML (shipped ones: {shipped}/*.yaml)")
    refusal = not_a_recipe(recipe)
    if refusal:
        raise RecipeRefusedError(refusal)
    try:
        check_verl_version()
    except UnsupportedVerlVersionError as error:
        raise RecipeRefusedError(one_line(error)) from None
    with _quiet():
        config = compose(recipe, overrides)
        if supplied is not None and (before := supplied(config)):
            config = compose(recipe, [*before, *overrides])
        _check_composed(config)
    return config


def check_model_config(config: Any, model_config: Path | None) -> None:
    """Hold ``--model-config``'s ``config.json`` to the support matrix, as the run holds the ``config.json`` of a
    local ``actor_rollout_ref.model.path``: ``check`` on a hub id refuses what the same model in a folder is refused
    for (a multimodal model, a mixture of experts on an engine that cannot check it).

    Raises:
        RecipeRefusedError: the file is no ``config.json``, or the matrix refuses the model.
    """
    if model_config is None:
        return
    from areal_plugins.builtin.validation import check_support_matrix
    from areal_plugins.planning.model_shapes import UnknownModelError, read_config

    try:
        hf_config = read_config(model_config)
    except UnknownModelError as error:
        raise RecipeRefusedError(str(error)) from None
    try:
        check_support_matrix(config, hf_config=hf_config)
    except ValueError as error:  # ArealConfigError
        raise RecipeRefusedError(one_line(error)) from None


#: ``plan``'s options a recipe can give, their recipe keys, and their values where neither the option nor a recipe
#: sets them (the paper's setting: 512 prompts x 16, answers up to 27,648 tokens, 200-token prompts, the 1.5B).
PLAN_RECIPE_KEYS = {
    "batch": ("data.train_batch_size", 512),
    "group": ("actor_rollout_ref.rollout.n", 16),
    "max_response": ("data.max_response_length", 27648),
    "model": ("actor_rollout_ref.model.path", "1.5b"),
}
PLAN_PROMPT = 200


def plan_options(args: Any) -> None:
    """Complete ``plan``'s options in place: an option given wins, then ``--recipe``'s key (composed as verl's
    ``main_ppo`` would, no check run), then the default; ``args.notes`` says what the recipe gave. The mean prompt
    (``--prompt-len``) is at most the recipe's ``data.max_prompt_length``."""
    from omegaconf import OmegaConf

    args.notes = []
    config = None
    if args.recipe is not None:
        refusal = None if args.recipe.is_file() else f"recipe {args.recipe} does not exist"
        refusal = refusal or not_a_recipe(args.recipe)
        if refusal:
            raise SystemExit(f"areal-plugins plan: {refusal}")
        try:
            with _quiet():
                config = compose(args.recipe.resolve(), list(args.overrides))
        except RecipeRefusedError as error:
            raise SystemExit(f"areal-plugins plan: {error}") from None
    elif args.overrides:
        raise SystemExit(f"areal-plugins plan: overrides ({' '.join(args.overrides)}) need --recipe")
    taken = []
    for option, (key, default) in PLAN_RECIPE_KEYS.items():
        if getattr(args, option) is None:
            value = OmegaConf.select(config, key) if config is not None else None
            if value is not None:
                taken.append(f"{key}={value}")
            chosen = default if value is None else int(value) if isinstance(default, int) else str(value)
            setattr(args, option, chosen)
    prompt_cap = int(OmegaConf.select(config, "data.max_prompt_length") or 0) if config is not None else 0
    if args.prompt_len is None:
        args.prompt_len = min(PLAN_PROMPT, prompt_cap) if prompt_cap else PLAN_PROMPT
    if config is not None:
        args.notes.append(f"recipe: {args.recipe.name} gives {', '.join(taken) or 'nothing the options did not set'}")


def not_a_recipe(recipe: Path) -> str | None:
    """Why ``recipe`` is no recipe (None: it may be one): not YAML, not a mapping, or a part recipes include.

    A part (``recipes/gpu/_gpu_grpo_1.5b.yaml``) has no ``defaults:`` list composing verl's ``ppo_trainer``, so
    composing it alone fails deep in an interpolation; this says what it is and which recipes include it.
    """
    import yaml

    try:
        document = yaml.safe_load(recipe.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        return f"{recipe.name} is not a recipe: not readable YAML ({one_line(error)})"
    if not isinstance(document, dict):
        kind = type(document).__name__
        return f"{recipe.name} is not a recipe: a recipe is a YAML mapping with a defaults: list, not a {kind}"
    if isinstance(document.get("defaults"), list):
        return None
    users = [other.name for other in sorted(recipe.parent.glob("*.yaml")) if _includes(other, recipe.stem)]
    if not users and not recipe.name.startswith("_"):
        return (
            f"{recipe.name} is not a recipe: it has no defaults: list composing verl's ppo_trainer (a recipe opens "
            "with defaults: [ppo_trainer, ..., _self_]; docs/guides/own_recipe.md)"
        )
    where = f": {', '.join(users)}" if users else ""
    return (
        f"{recipe.name} is a part that recipes include (no defaults: list composing verl's ppo_trainer), "
        f"not a recipe; check a recipe that includes it{where}"
    )


def _includes(recipe: Path, part: str) -> bool:
    import yaml

    try:
        document = yaml.safe_load(recipe.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    defaults = document.get("defaults") if isinstance(document, dict) else None
    return isinstance(defaults, list) and part in [str(entry) for entry in defaults if isinstance(entry, str)]


def run_platform(device: str, local_accelerator: bool, cluster: str | None, preset: str | None) -> str | None:
    """The ``VERL_PLATFORM`` the run's processes get, from the recipe's ``trainer.device``; None: verl's own
    detection in each process.

    The recipe decides, not the machine the command runs on: a CPU-only head node of a GPU cluster is normal,
    and its lack of a GPU must not put the cluster's workers on the CPU platform.

    Raises:
        RecipeRefusedError: a GPU recipe with neither a local GPU nor a Ray cluster to run on.
    """
    if preset:
        return preset
    if device == "cpu":
        return "cpu"
    if not local_accelerator and cluster is None:
        raise RecipeRefusedError(
            f"trainer.device={device}, but this machine has no GPU and joins no Ray cluster: set RAY_ADDRESS (or "
            "ray_kwargs.ray_init.address) to your GPU cluster's head, or run a CPU recipe (trainer.device=cpu)"
        )
    return None


def compose(recipe: Path, overrides: list[str]) -> Any:
    """The config ``python -m verl.trainer.main_ppo --config-path DIR --config-name NAME OVERRIDES`` builds."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    import areal_plugins.verl_plugin  # noqa: F401  (registers the resolvers recipes use)

    try:
        with initialize_config_dir(config_dir=str(recipe.parent.resolve()), version_base=None):
            return hydra_compose(config_name=recipe.stem, overrides=overrides)
    except OverrideParseException as error:
        bad = re.search(r"Error parsing override '([^']*)'", str(error))
        shown = bad.group(1) if bad else " ".join(overrides)
        raise RecipeRefusedError(
            f"cannot read the override {shown!r}: write KEY=VALUE (e.g. trainer.total_training_steps=10)"
        ) from None
    except MissingConfigException as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        options = [line for line in lines[2:] if not line.startswith(("Config search path", "provider="))]
        hint = f"; available: {', '.join(options)}" if options else ""
        raise RecipeRefusedError(f"{recipe.name}: {lines[0]}{hint}") from None
    except (HydraException, OmegaConfBaseException) as error:
        cause = error.__cause__ or error
        missing = _NOT_IN_STRUCT.search(str(cause))
        if missing:
            raise RecipeRefusedError(_unknown_key_message(recipe, overrides, missing.group(2))) from None
        raise RecipeRefusedError(f"{recipe.name}: {one_line(error)}") from None


def _unknown_key_message(recipe: Path, overrides: list[str], full_key: str) -> str:
    """``unknown setting a.b_c; did you mean a.b?`` from the keys the recipe does have at that level."""
    from omegaconf import OmegaConf

    parent, _, leaf = full_key.rpartition(".")
    others = [o for o in overrides if not o.lstrip("+~").startswith(f"{full_key}=")]
    try:
        base = compose(recipe, others)
        node = OmegaConf.select(base, parent) if parent else base
        keys = list(node.keys()) if OmegaConf.is_dict(node) else []
    except RecipeRefusedError:
        keys = []
    close = difflib.get_close_matches(leaf, [str(k) for k in keys], n=1)
    where = f"{parent}.{close[0]}" if parent and close else (close[0] if close else None)
    hint = f"did you mean {where}?" if where else f"a new key needs a leading + (+{full_key}=...)"
    if full_key.startswith("areal.") and not where:
        # verl's own recipe (or one without our config group) has no areal node until +areal.enable=true adds one.
        given = next((o.lstrip("+~") for o in overrides if o.lstrip("+~").startswith(f"{full_key}=")), None)
        hint = (
            f"the recipe's defaults do not list `areal: default`, so every areal key on the command line takes a "
            f"leading + as +areal.enable=true does: write +{given or full_key + '=...'} (++ works with or without "
            "the group; docs/guides/own_recipe.md)"
        )
    return f"unknown setting {full_key}; {hint}"


def _check_composed(config: Any) -> None:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from areal_plugins.config.routing import route_composed_config
    from areal_plugins.config.settings import areal_settings
    from areal_plugins.plugin_manager import PluginError

    try:
        areal = areal_settings(config)  # no areal node: the defaults, enable false
        route_composed_config(config)
        OmegaConf.resolve(config)
    except ValueError as error:  # ArealConfigError, or a resolver's refusal
        raise RecipeRefusedError(one_line(error)) from None
    except OmegaConfBaseException as error:
        raise RecipeRefusedError(f"the recipe cannot be resolved: {one_line(error)}") from None
    _verl_validation(config)
    if areal.enable:
        from areal_plugins.plugin_manager import Hooks, build_plugin_manager

        try:  # the run's plugin selection, in a manager of our own: this process's plugins stay as they are
            manager = build_plugin_manager(include=areal.plugins.include, exclude=list(areal.plugins.exclude))
            Hooks(manager).validate_config(config=config)
        except PluginError as error:
            raise RecipeRefusedError(_plugin_refusal(error)) from None


def _plugin_refusal(error: Any) -> str:
    """A ``ValueError`` is how a plugin refuses settings (the hook's contract): show its message, and whose."""
    cause = error.__cause__
    if not isinstance(cause, ValueError):
        return one_line(error)
    builtin = (error.plugin or "").startswith("areal_plugins.")
    return one_line(cause) if builtin else f"plugin {error.plugin!r} refuses the recipe: {one_line(cause)}"


def _verl_validation(config: Any) -> None:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        validate_config(
            config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
        )
    except (AssertionError, ValueError, TypeError, KeyError) as error:
        raise RecipeRefusedError(f"verl refuses the recipe: {one_line(error) or type(error).__name__}") from None


def one_line(error: BaseException) -> str:
    """An error's message on one line (Hydra and omegaconf spread theirs over several)."""
    return " ".join(part.strip() for part in str(error).splitlines() if part.strip())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """verl's import-time chatter (absent engines, platform probing, prints) is noise on a refusal's terminal."""
    handlers = list(logging.getLogger().handlers)  # a copy: an import inside may add a handler (megatron's does)
    levels = [handler.level for handler in handlers]
    for handler in handlers:
        handler.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for handler, level in zip(handlers, levels, strict=True):
            handler.setLevel(level)
