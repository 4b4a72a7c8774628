"""What tells apart prompts of one text: a digest of the pictures a request carries.

A vision-language model's prompt holds each picture as placeholder tokens that are the same whatever the picture,
so "What is <image> + 3?" about two pictures is one token sequence. Wherever a prompt is identified by its tokens
(the records' ``prompt_digest``, the replay's claim of a recorded request, a checkpoint's kept output), its pictures'
digest is mixed in (:func:`areal_plugins.core.trajectory_rows.prompt_digest`).
"""

from __future__ import annotations

import hashlib
from typing import Any


def media_digest(request_kwargs: dict[str, Any]) -> str | None:
    """16 hex digits of the SHA-256 of a request's pictures (``image_data``: PIL images, or bytes), in order; None
    without pictures."""
    images = request_kwargs.get("image_data")
    if not images:
        return None
    digest = hashlib.sha256()
    for image in images:
        if isinstance(image, bytes | bytearray):
            digest.update(bytes(image))
        elif hasattr(image, "tobytes"):  # a PIL image: its pixels, with the size and mode that lay them out
            digest.update(f"{image.mode}:{image.size}:".encode())
            digest.update(image.tobytes())
        else:
            raise TypeError(f"a request's image_data holds a {type(image).__name__}, neither a PIL image nor bytes")
    return digest.hexdigest()[:16]
