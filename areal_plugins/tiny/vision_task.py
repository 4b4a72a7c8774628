"""The CPU demo's image task: count the squares in a picture and add a number, in verl's RL parquet format.

"What is <image> + 3?" with a picture of 4 black squares asks for 7: the vision tower must count, the language model
add. A picture is 56 x 56 pixels, a 4 x 4 grid of Qwen2-VL's 14-pixel patches, and each square fills one patch, so a
patch is all black or all white; 2 x 2 patches merge into each of the picture's 4 prompt tokens. The reward is the
addition task's (math-verify on the exact sum).

Measured here: a drawn digit (the first version of this task) was not learned by the one-block vision tower in 300
warm-start steps (greedy accuracy 0.09-0.12, its features collapsing to one vector); counting whole patches is.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path

from areal_plugins.tiny import cpu_demo_module
from areal_plugins.tiny.task import DATA_SOURCE

#: Qwen2-VL's patch side, in pixels; a square fills one patch.
PATCH = 14
#: Patches per side of a picture: 4 x 4 patches, 2 x 2 merged tokens.
GRID = 4
#: Side of every picture, in pixels: a multiple of Qwen2-VL's merged patch (2 x 14), so no resize is needed.
IMAGE_SIDE = PATCH * GRID
#: verl's placeholder of an image in a prompt's text (``RLHFDataset`` splits the content on it).
IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class PictureProblem:
    """``shown + added``: ``shown`` squares in the picture, ``added`` written in the question."""

    shown: int
    added: int
    #: The grid cells (row-major, 0 to GRID**2 - 1) the squares fill.
    cells: tuple[int, ...]

    @property
    def question(self) -> str:
        return f"What is {IMAGE_PLACEHOLDER} + {self.added}?"

    @property
    def answer(self) -> str:
        return str(self.shown + self.added)


def make_picture_problems(count: int, seed: int) -> list[PictureProblem]:
    """``count`` problems (0-9 squares in random cells, 0-9 added), deterministic for ``seed``."""
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        shown = rng.randint(0, 9)
        problems.append(PictureProblem(shown, rng.randint(0, 9), tuple(sorted(rng.sample(range(GRID * GRID), shown)))))
    return problems


def draw(problem: PictureProblem):
    """The problem's picture (a PIL image, RGB): black squares on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), (255, 255, 255))
    canvas = ImageDraw.Draw(image)
    for cell in problem.cells:
        top, left = divmod(cell, GRID)
        canvas.rectangle((left * PATCH, top * PATCH, (left + 1) * PATCH - 1, (top + 1) * PATCH - 1), fill=(0, 0, 0))
    return image


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def to_verl_row(problem: PictureProblem, split: str, index: int) -> dict:
    """One row as verl's ``RLHFDataset`` reads an image task (``images``: the pictures, in placeholder order)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.question}],
        "images": [{"bytes": png_bytes(draw(problem))}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": problem.answer},
        "extra_info": {"split": split, "index": index},
    }


def write_picture_dataset(out_dir: Path, train_size: int, test_size: int, seed: int) -> dict[str, Path]:
    """Write ``train.parquet`` and ``test.parquet``; return their paths."""
    pd = cpu_demo_module("pandas", "the tiny image task's data (parquet files)")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, size, split_seed in (("train", train_size, seed), ("test", test_size, seed + 1)):
        rows = [to_verl_row(p, split, i) for i, p in enumerate(make_picture_problems(size, split_seed))]
        paths[split] = out_dir / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(paths[split])
    return paths
