"""Generation: prompts left-padded by padless whatever the tokenizer says, on every backend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from padless.forward.attention import attention_in_use
from padless.proof.load import load_model
from padless.rl.generate import HFEngine, SeededSampler, cut_at_eos, decoding_attention, generate, left_pad


def test_left_pad_right_aligns_prompts():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        left_pad([[1], []], 0, torch.device("cpu"))


def test_cut_at_eos_keeps_first_eos_and_drops_padding():
    assert cut_at_eos([4, 5, 2, 7, 2], {2}, 0) == ([4, 5, 2], True)
    assert cut_at_eos([4, 5, 0, 0], {2}, 0) == ([4, 5], False)


@pytest.mark.parametrize(
    ("backend", "side"),
    [
        ("varlen", "left"),
        ("varlen", "right"),
        ("sdpa", "right"),
        ("eager", "right"),
        ("flex_attention", "right"),
    ],
)
def test_batched_generation_equals_one_by_one(tokenizer, backend, side):
    model = load_model("tiny-qwen2", attn_implementation=backend)
    tokenizer.padding_side = side  # must not matter: padless pads prompts itself
    messages = ["What is 2 + 2?", "Write a long, gentle story about a kite and a small dog.", "Hi"]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for m in messages
    ]
    batched = generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=3)
    alone = [generate(model, tokenizer, [p], max_new_tokens=6)[0] for p in prompts]
    assert [c.completion_ids for c in batched] == [c.completion_ids for c in alone]
    assert all(len(c.completion_ids) >= 1 for c in batched)
    assert attention_in_use(model) == backend  # decoding switched kernels and switched back


def test_decoding_attention_restores_backend_on_error():
    model = load_model("tiny-llama")
    with pytest.raises(RuntimeError), decoding_attention(model):
        assert attention_in_use(model) == "sdpa"
        raise RuntimeError("boom")
    assert attention_in_use(model) == "varlen"


def test_a_checkpoints_generation_config_does_not_reshape_sampling(tokenizer):
    """top_k 1 would make every sample the greedy one, a repetition penalty would change greedy choices:
    padless samples from the model's own distribution whatever its generation_config says."""
    model = load_model("tiny-qwen2")
    prompt = [tokenizer("Tell me a story")["input_ids"]]
    plain_greedy = generate(model, tokenizer, prompt, max_new_tokens=12)
    model.generation_config.top_k = 1
    model.generation_config.repetition_penalty = 50.0
    torch.manual_seed(0)
    samples = generate(
        model, tokenizer, prompt, max_new_tokens=12, do_sample=True, num_return_sequences=8, batch_size=8
    )
    assert len({tuple(c.completion_ids) for c in samples}) > 1
    greedy = generate(model, tokenizer, prompt, max_new_tokens=12)
    assert greedy[0].completion_ids == plain_greedy[0].completion_ids


# ----------------------------------------------------------------------------------------------------------
# Vision-language generation: left-padded prompts with images (the seed crash of the VLM bug reports)
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm_prompts():
    """Image prompts of different lengths (image sizes differ) from the embedded shapes data."""
    from padless.data import load_rows, tokenize_prompts
    from padless.data.images import ImageInputs
    from padless.data.sources import load_processor
    from padless.tiny import tiny_config

    processor = load_processor("tiny-qwen2.5-vl")
    inputs = ImageInputs(processor, tiny_config("tiny-qwen2.5-vl"))
    prompts, _ = tokenize_prompts(
        load_rows("tiny:shapes_rl")[:6], processor.tokenizer, max_prompt_length=64, images=inputs
    )
    assert len({len(p) for p in prompts}) > 1, "prompts must differ in length so some get padded"
    return processor.tokenizer, [p.prompt_ids for p in prompts], [p.vision for p in prompts]


def _sharp_vlm(backend: str) -> torch.nn.Module:
    """The tiny VLM with weights scaled up so greedy tokens depend on positions (a fresh one is flat)."""
    model = load_model("tiny-qwen2.5-vl", attn_implementation=backend)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


@pytest.mark.parametrize(("backend", "side"), [("varlen", "right"), ("varlen", "left"), ("eager", "right")])
def test_batched_vlm_generation_equals_one_by_one(vlm_prompts, backend, side):
    tokenizer, prompts, vision = vlm_prompts
    tokenizer.padding_side = side  # must not matter: padless pads prompts itself
    model = _sharp_vlm(backend)
    batched = generate(model, tokenizer, prompts, vision=vision, max_new_tokens=10, batch_size=6)
    alone = [
        generate(model, tokenizer, [p], vision=[v], max_new_tokens=10, batch_size=1)[0]
        for p, v in zip(prompts, vision, strict=True)
    ]
    assert [c.completion_ids for c in batched] == [c.completion_ids for c in alone]
    assert len({tuple(c.completion_ids) for c in alone}) > 1  # the images steer the output
    assert attention_in_use(model) == backend


def test_vlm_generation_without_token_types_would_differ(vlm_prompts, monkeypatch):
    """Without mm_token_type_ids transformers misplaces left-padded image tokens: the test above can fail."""
    import padless.rl.generate as rollout

    tokenizer, prompts, vision = vlm_prompts
    model = _sharp_vlm("varlen")
    alone = [
        generate(model, tokenizer, [p], vision=[v], max_new_tokens=10)[0]
        for p, v in zip(prompts, vision, strict=True)
    ]
    real = rollout.image_inputs
    monkeypatch.setattr(
        rollout,
        "image_inputs",
        lambda *a: {k: v for k, v in real(*a).items() if k != "mm_token_type_ids"},
    )
    batched = generate(model, tokenizer, prompts, vision=vision, max_new_tokens=10, batch_size=6)
    assert [c.completion_ids for c in batched] != [c.completion_ids for c in alone]


def test_a_vlm_policy_never_samples_an_image_placeholder(vlm_prompts, monkeypatch):
    """The tiny VLM with its image / video placeholders' (tied) output rows lifted above every other token:
    unfiltered, the seeded sampler draws them (their pixels would not exist, and the next forward stops on
    the count); filtered, never, and it still records log-probs of the whole tempered distribution."""
    import padless.rl.generate as rollout

    tokenizer, prompts, vision = vlm_prompts
    model = load_model("tiny-qwen2.5-vl", probe=False)
    forbidden = rollout.placeholder_ids(model.config)
    assert set(forbidden) == {model.config.image_token_id, model.config.video_token_id}
    with torch.no_grad():
        rows = model.get_input_embeddings().weight
        rows[:, 0] = 0.5
        rows[list(forbidden), 0] = 4.0

    def sample() -> list:
        return generate(
            model,
            tokenizer,
            prompts[:2],
            vision=vision[:2],
            max_new_tokens=4,
            do_sample=True,
            seeds=[1, 2],
            num_return_sequences=2,
        )

    completions = sample()
    sampled = [t for c in completions for t in c.completion_ids]
    assert sampled and not set(sampled) & set(forbidden)
    # the filter removed most of the mass: the recorded log-probs are the unfiltered policy's
    assert max(lp for c in completions for lp in c.logprobs) < -1.0
    monkeypatch.setattr(rollout, "placeholder_ids", lambda config: ())
    assert {t for c in sample() for t in c.completion_ids} & set(forbidden)


# ----------------------------------------------------------------------------------------------------------
# Batched seeded sampling: a prompt's samples are a function of its seed, whatever batch it is sampled in
# ----------------------------------------------------------------------------------------------------------


def _chat_prompts(tokenizer, messages: list[str]) -> list[list[int]]:
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for m in messages
    ]


def test_seeded_samples_are_independent_of_batch_and_order(tokenizer):
    """Alone, batched, and batched in reverse order: the same tokens per (prompt, seed), and log-probs equal
    up to fp32 round-off (left padding changes the decode's reductions, not the math: 1e-5 on log-probs of
    magnitude <= ~10 is ~8 float32 ulps)."""
    model = load_model("tiny-qwen2")
    prompts = _chat_prompts(tokenizer, ["What is 2 + 2?", "Write a gentle story about a kite.", "Hi"])
    seeds = [11, 22, 33]
    rollout = SimpleNamespace(
        max_new_tokens=8, temperature=0.9, top_p=1.0, generation_batch_size=32, routing_replay=False
    )
    engine = HFEngine(model, tokenizer, rollout)
    batched = engine.complete(prompts, 2, seeds)
    alone = [c for p, s in zip(prompts, seeds, strict=True) for c in engine.complete([p], 2, [s])]
    backwards = engine.complete(prompts[::-1], 2, seeds[::-1])
    backwards = [c for i in (2, 1, 0) for c in backwards[2 * i : 2 * i + 2]]
    for a, b, c in zip(batched, alone, backwards, strict=True):
        assert a.prompt_ids == b.prompt_ids == c.prompt_ids
        assert a.completion_ids == b.completion_ids == c.completion_ids
        assert len(a.logprobs) == len(a.completion_ids)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(c.logprobs), rtol=0, atol=1e-5)
    assert len({tuple(c.completion_ids) for c in batched}) == 6  # every sample its own draw
    assert (
        engine.complete(prompts[:1], 2, [12])[0].completion_ids != batched[0].completion_ids
    )  # seed matters


def test_seeded_sampler_draws_from_the_tempered_top_p_distribution():
    """4,000 rows of one step over fixed logits: frequencies within 4 standard errors of softmax(logits / T)
    restricted to the top-p set, and the recorded log-prob is the full tempered one (before top-p)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]]).repeat(4000, 1)
    temperature = 0.8
    full = torch.log_softmax(logits[0] / temperature, -1)
    for top_p, allowed in ((1.0, 5), (0.8, 2)):
        sampler = SeededSampler(list(range(4000)), temperature, top_p, torch.device("cpu"))
        scores = sampler(torch.zeros(4000, 1, dtype=torch.long), logits.clone())
        tokens = scores.argmax(-1)
        assert torch.isinf(scores).sum(-1).eq(4).all()  # one finite score per row: generate takes it
        p = full.exp()[:allowed] / full.exp()[:allowed].sum()
        freq = torch.bincount(tokens, minlength=5).float() / 4000
        assert freq[allowed:].sum() == 0
        assert ((freq[:allowed] - p).abs() <= 4 * (p * (1 - p) / 4000).sqrt() + 1e-9).all(), (freq, p)
        torch.testing.assert_close(sampler.logprobs[0], full[tokens], rtol=0, atol=0)


def test_sampler_logprobs_equal_the_trainers_on_fp32_weights(tokenizer):
    """The HF engine samples the trainer's own fp32 weights: its log-probs equal the packed training
    forward's to fp32 round-off (KV-cache decode on sdpa vs packed varlen reduce in another order; 1e-5 on
    log-probs of magnitude <= ~10 is ~8 float32 ulps; measured 9.5e-7)."""
    from padless.forward.engine import ModelEngine
    from padless.forward.packing import Example, pack

    model = load_model("tiny-qwen2")
    prompts = _chat_prompts(tokenizer, ["What is 2 + 2?", "Write a gentle story about a kite.", "Hi"])
    rollout = SimpleNamespace(
        max_new_tokens=10, temperature=0.7, top_p=0.9, generation_batch_size=32, routing_replay=False
    )
    completions = HFEngine(model, tokenizer, rollout).complete(prompts, 2, [1, 2, 3])
    examples = [
        Example(c.prompt_ids + c.completion_ids, [False] * len(c.prompt_ids) + [True] * len(c.completion_ids))
        for c in completions
    ]
    batch = pack(examples, device=torch.device("cpu"))
    with torch.no_grad():
        trainer = ModelEngine(model)(batch, logps=True, temperature=0.7).logps[batch.loss_mask[0]]
    sampler = torch.tensor([v for c in completions for v in c.logprobs])
    assert sampler.numel() == trainer.numel() > 20
    torch.testing.assert_close(sampler, trainer, rtol=0, atol=1e-5)


def test_hybrid_cached_decoding_equals_one_by_one_and_the_packed_forward(tokenizer):
    """The embedded gated delta-net hybrid decodes with its own cache (conv and recurrent states): seeded
    samples of a left-padded batch equal each prompt alone, token for token, and their log-probs equal
    the packed training forward's (per-sequence delta-net path) to fp32 round-off (1e-5, as above)."""
    from padless.forward.engine import ModelEngine
    from padless.forward.packing import Example, pack

    model = load_model("tiny-qwen3.5")
    prompts = _chat_prompts(tokenizer, ["What is 2 + 2?", "Write a gentle story about a kite.", "Hi"])
    seeds = [11, 22, 33]
    rollout = SimpleNamespace(
        max_new_tokens=8, temperature=0.9, top_p=1.0, generation_batch_size=32, routing_replay=False
    )
    engine = HFEngine(model, tokenizer, rollout)
    batched = engine.complete(prompts, 2, seeds)
    alone = [c for p, s in zip(prompts, seeds, strict=True) for c in engine.complete([p], 2, [s])]
    for a, b in zip(batched, alone, strict=True):
        assert a.completion_ids == b.completion_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    examples = [
        Example(c.prompt_ids + c.completion_ids, [False] * len(c.prompt_ids) + [True] * len(c.completion_ids))
        for c in batched
    ]
    batch = pack(examples, device=torch.device("cpu"))
    with torch.no_grad():
        trainer = ModelEngine(model)(batch, logps=True, temperature=0.9).logps[batch.loss_mask[0]]
    sampler = torch.tensor([v for c in batched for v in c.logprobs])
    assert sampler.numel() == trainer.numel() > 20
    torch.testing.assert_close(sampler, trainer, rtol=0, atol=1e-5)
