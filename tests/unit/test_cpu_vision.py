"""The tiny vision-language model on our CPU engine (rollout/cpu/vision.py) and the trainer's M-RoPE positions
(patches/vlm_position_ids.py).

References are independent of the engine: transformers' own forward over the prompt and the generated tokens with
the same pixels, which computes its own M-RoPE positions (``get_rope_index``); and for the trainer's batch, the
samples the nested tensor was built from.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from areal_plugins.rollout.cpu.engine import ContinuousBatchingEngine
from areal_plugins.rollout.cpu.vision import load_model
from areal_plugins.tiny.model import WORKLOADS, build_tiny_model
from areal_plugins.tiny.vision_model import picture_messages
from areal_plugins.tiny.vision_task import draw, make_picture_problems

STEPS = 10


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    """The ``vision`` workload as the builder writes it (tokenizer, processor code, HF format), untrained, with its
    weights redrawn wider (std 0.3, seeded) so that tokens and log-probs depend on the picture."""
    from transformers import AutoModelForImageTextToText

    out = tmp_path_factory.mktemp("tiny_vlm")
    build_tiny_model(out, dataclasses.replace(WORKLOADS["vision"], warmstart_steps=0))
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def served(vlm_dir):
    model, image_prompts = load_model(str(vlm_dir), trust_remote_code=True)
    return model, image_prompts


def prompts(processor, count: int):
    """``count`` image-task prompts as verl's agent loop sends them: ids with the placeholders expanded, pictures."""
    out = []
    for problem in make_picture_problems(count, seed=3):
        text = processor.apply_chat_template(
            picture_messages(problem.question), add_generation_prompt=True, tokenize=False
        )
        picture = draw(problem)
        encoded = processor(text=[text], images=[picture], return_tensors="pt")
        out.append((encoded, picture))
    return out


def reference_logprobs(model, encoded, tokens: list[int]) -> torch.Tensor:
    """transformers' log-probs of ``tokens`` after the prompt, in one forward with the pictures."""
    ids = torch.cat([encoded["input_ids"], torch.tensor([tokens])], dim=1)
    token_types = torch.cat([encoded["mm_token_type_ids"], torch.zeros(1, len(tokens), dtype=torch.int)], dim=1)
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=encoded["pixel_values"],
            image_grid_thw=encoded["image_grid_thw"],
            mm_token_type_ids=token_types,
        ).logits
    start = encoded["input_ids"].shape[1] - 1
    return torch.log_softmax(logits[0, start:-1].float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def generate(engine, requests, **kwargs):
    async def run():
        return await asyncio.gather(
            *[
                engine.generate(ids, STEPS, request_id=str(i), ignore_eos=True, images=[picture], **kwargs)
                for i, (ids, picture) in enumerate(requests)
            ]
        )

    return asyncio.run(run())


def test_the_engines_log_probs_with_pictures_equal_transformers_forward(served):
    from transformers import AutoProcessor

    model, image_prompts = served
    processor = AutoProcessor.from_pretrained(model.name_or_path, trust_remote_code=True)
    batch = prompts(processor, 3)
    engine = ContinuousBatchingEngine(model, [processor.tokenizer.eos_token_id], image_prompts=image_prompts)
    outputs = generate(engine, [(encoded["input_ids"][0].tolist(), picture) for encoded, picture in batch])
    for (encoded, _), out in zip(batch, outputs, strict=True):
        assert len(out.token_ids) == STEPS
        expected = reference_logprobs(model, encoded, out.token_ids)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4), (out.logprobs, expected)
    # The pictures matter: the same prompts with each other's pictures give other log-probs.
    swapped = generate(
        engine,
        [(batch[i][0]["input_ids"][0].tolist(), batch[(i + 1) % 3][1]) for i in range(3)],
        temperature=0.0,
    )
    plain = generate(
        engine, [(encoded["input_ids"][0].tolist(), picture) for encoded, picture in batch], temperature=0.0
    )
    assert any(a.logprobs != b.logprobs for a, b in zip(swapped, plain, strict=True))


def test_a_resubmitted_request_continues_as_if_never_cut(served):
    """verl's client resubmits an interrupted request as prompt + partial output with the same pictures."""
    from transformers import AutoProcessor

    model, image_prompts = served
    processor = AutoProcessor.from_pretrained(model.name_or_path, trust_remote_code=True)
    (encoded, picture), *_ = prompts(processor, 1)
    engine = ContinuousBatchingEngine(model, [processor.tokenizer.eos_token_id], image_prompts=image_prompts)
    prompt = encoded["input_ids"][0].tolist()
    (whole,) = generate(engine, [(prompt, picture)], temperature=0.0)
    cut = 4
    (rest,) = generate(engine, [(prompt + whole.token_ids[:cut], picture)], temperature=0.0)
    assert rest.token_ids[: STEPS - cut] == whole.token_ids[cut:]
    assert torch.allclose(torch.tensor(rest.logprobs[: STEPS - cut]), torch.tensor(whole.logprobs[cut:]), atol=1e-5)


def test_a_prompt_whose_placeholders_do_not_match_its_pictures_is_refused(served):
    from transformers import AutoProcessor

    model, image_prompts = served
    processor = AutoProcessor.from_pretrained(model.name_or_path, trust_remote_code=True)
    (encoded, picture), *_ = prompts(processor, 1)
    ids = encoded["input_ids"][0].tolist()
    with pytest.raises(ValueError, match="must carry its images again"):
        image_prompts.prompt(ids, None)
    placeholder = processor.image_token_id
    with pytest.raises(ValueError, match="3 image placeholder tokens, its 1 images 4 merged patches"):
        image_prompts.prompt(
            [t for i, t in enumerate(ids) if not (t == placeholder and i == ids.index(placeholder))], [picture]
        )
    text_only = ContinuousBatchingEngine(model, [processor.tokenizer.eos_token_id])
    with pytest.raises(ValueError, match="reached a text-only model"):
        asyncio.run(text_only.generate(ids, 2, images=[picture]))


def test_the_trainers_position_ids_keep_their_samples_whatever_their_lengths():
    """verl's batches hold (4, tokens) M-RoPE positions per sample as a nested tensor; with every sample of one
    length torch lays it out ragged in its first dimension and verl relabels it, so selecting rows split the wrong
    dimension. The patched relabelling rebuilds it, and rows then come back as the samples they were."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from patches import vlm_position_ids

    for lengths in ((6, 6, 6), (5, 7, 6)):
        samples = [torch.arange(4 * n).view(4, n) + 100 * i for i, n in enumerate(lengths)]
        ids = [torch.arange(n) for n in lengths]

        def batch(samples=samples, ids=ids):
            return TensorDict(
                {
                    "position_ids": torch.nested.as_nested_tensor(samples, layout=torch.jagged),
                    "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
                },
                batch_size=[3],
            )

        original = batch()
        tu.maybe_fix_3d_position_ids(original)  # verl's own
        if len(set(lengths)) == 1:
            with pytest.raises(RuntimeError):  # split_with_sizes ..., or a failed check of the same cut
                tu.index_select_tensor_dict(original, [2, 0])
        fixed = batch()
        vlm_position_ids._replacement(tu.maybe_fix_3d_position_ids)(fixed)
        # The layout verl's engine reads, with and without padding removal: values (4, all tokens), ragged in tokens.
        assert fixed["position_ids"].values().shape == (4, sum(lengths)) and fixed["position_ids"]._ragged_idx == 2
        rows = tu.index_select_tensor_dict(fixed, [2, 0])["position_ids"].unbind()
        assert [r.tolist() for r in rows] == [samples[2].tolist(), samples[0].tolist()]


def test_a_text_models_positions_are_left_to_verl():
    """The patch is on for every areal run: a batch without 3-D positions goes to verl's own function untouched."""
    from tensordict import TensorDict

    from patches import vlm_position_ids

    seen = []
    batch = TensorDict(
        {"position_ids": torch.nested.as_nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged)},
        batch_size=[2],
    )
    before = batch["position_ids"]
    vlm_position_ids._replacement(seen.append)(batch)
    assert seen == [batch] and batch["position_ids"] is before


def test_prompts_of_one_text_with_other_pictures_are_other_groups():
    """A picture's placeholders are the same tokens whatever the picture: the tests' holds tell groups apart by the
    pictures' digest too (else every picture of one question was one group, and nothing was held)."""
    from areal_plugins.testing.holds import FinishFirstGroups

    holds = FinishFirstGroups(1)
    assert not holds.holds([1, 2, 3], "picture a")
    assert holds.holds([1, 2, 3], "picture b")
    assert not holds.holds([1, 2, 3, 9], "picture a")  # a resubmission of a's request: a's group


def test_prompts_of_one_text_with_other_pictures_have_other_digests():
    """The records', the replay's and the checkpoint's identity of a prompt: its tokens, and its pictures if any."""
    from areal_plugins.core.trajectory_rows import images_digest, prompt_digest, token_digest

    problems = make_picture_problems(2, seed=3)
    ids = [1, 2, 3]
    first, second = (images_digest([draw(p)]) for p in problems)
    assert first != second and first == images_digest([draw(problems[0])])
    assert images_digest(None) is None and prompt_digest(ids, None) == token_digest(ids)  # a text prompt's, as before
    assert len({prompt_digest(ids, first), prompt_digest(ids, second), token_digest(ids)}) == 3
