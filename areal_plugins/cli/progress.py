"""What the CLI prints while verl runs: a line per step, verl's startup milestones, the error that stopped it.

verl logs ``step:N - key:value - ...`` lines; a few of their values make the progress line. The recipe's
step count is read from its files (and the overrides) without composing it again.
"""

from __future__ import annotations

import re
from pathlib import Path

STEP_LINE = re.compile(r"step:(\d+) - (.*)")


#: The last line of a Python traceback (``module.SomeError: message``), behind Ray's ``(Actor pid=1)`` prefix.
ERROR_LINE = re.compile(r"^(?:\(.*?\)\s*)?((?:[\w.]+\.)?\w+(?:Error|Exception|Exit|Interrupt)\b:?.*)$")

#: The terminal colour codes Ray wraps its ``(Actor pid=1)`` prefix in (``\x1b[36m(...)\x1b[0m``).
_ANSI_CODE = re.compile(r"\x1b\[[0-9;]*m")


def error_in(line: str) -> re.Match[str] | None:
    """:data:`ERROR_LINE`'s match on ``line`` with Ray's colour codes taken out (None: not an error line). Ray
    colours the prefix in some setups and not others; a coloured watchdog stop was named as the ActorDiedError
    that followed it."""
    last = line.rstrip("\r\n").rsplit("\r", 1)[-1]  # a progress bar redrawn with \r before it on the same line
    return ERROR_LINE.match(_ANSI_CODE.sub("", last).strip())


#: verl's own milestones worth a progress line while the (slow, ~1.5 min) startup runs.
MILESTONES = {
    "actor and ref model engine initialized": "trainer workers ready",
    "checkpoint engine manager initialized": "rollout servers ready",
    "all initialize finished": "verl initialised; training",
    "validation metrics": "validation done",
}


PROGRESS_KEYS = (
    ("critic/score/mean", "reward"),
    ("actor/pg_loss", "pg_loss"),
    ("response_length/mean", "resp_len"),
    ("timing_s/gen", "gen_s"),
    ("timing_s/update_actor", "train_s"),
    ("timing_s/step", "step_s"),
)


def parse_metrics(fields: str) -> dict[str, float]:
    """Parse verl's console line ``k1:v1 - k2:np.float64(v2) - ...`` into floats."""
    values: dict[str, float] = {}
    for item in fields.split(" - "):
        key, _, raw = item.partition(":")
        raw = re.sub(r"^np\.\w+\((.*)\)$", r"\1", raw.strip())
        try:
            values[key.strip()] = float(raw)
        except ValueError:
            continue
    return values


def format_progress(step: int, total: str, fields: str) -> str:
    values = parse_metrics(fields)
    parts = []
    if any(key in values for key, _ in PROGRESS_KEYS):
        parts.append(
            f"step {step}/{total}  "
            + "  ".join(f"{label}={values[key]:.3g}" for key, label in PROGRESS_KEYS if key in values)
        )
    validation = {k.split("/", 1)[1]: v for k, v in values.items() if k.startswith("val-core/")}
    if validation:
        shown = "  ".join(f"{k}={v:.3g}" for k, v in validation.items())
        parts.append(f"validation after step {step}: {shown}")
    return "\n".join(parts)


def recipe_files(recipe: Path) -> list[Path]:
    """The recipe and the shared files of its directory that its defaults list includes."""
    import yaml

    files = [recipe]
    for entry in (yaml.safe_load(recipe.read_text()) or {}).get("defaults", []):
        shared = recipe.parent / f"{entry}.yaml" if isinstance(entry, str) else None
        if shared is not None and shared.exists():
            files.append(shared)
    return files


def recipe_value(recipe: Path, overrides: list[str], section: str, key: str) -> str | None:
    """``section.key`` from the overrides, else from the recipe's files (the recipe before its shared files)."""
    import yaml

    for override in overrides:
        if override.lstrip("+").startswith(f"{section}.{key}="):
            return override.split("=", 1)[1]
    for path in recipe_files(recipe):
        value = ((yaml.safe_load(path.read_text()) or {}).get(section) or {}).get(key)
        if value is not None:
            return str(value)
    return None


def total_steps(recipe: Path, overrides: list[str]) -> str:
    """``trainer.total_training_steps`` from the overrides, else from the recipe's files."""
    return recipe_value(recipe, overrides, "trainer", "total_training_steps") or "?"
