"""The model engine: every head inside one forward, and scores read where transformers reads them."""

from __future__ import annotations

import pytest
import torch

from padless.forward.engine import (
    ModelEngine,
    forward_packed,
    forward_scores,
    score_positions,
    sequence_scores,
    use_backend,
)
from padless.forward.packing import Example, pack, to_padded
from padless.proof.load import load_model
from padless.proof.probe import bound
from padless.tiny import build_tiny_model, tiny_tokenizer


def test_engine_outputs_are_the_model_functions(probe_seqs):
    """Log-probs, entropy and values from one engine forward equal the functions each head runs."""
    policy = load_model("tiny-llama")
    value = load_model("tiny-llama", task="score", seed=1)
    engine = ModelEngine(policy, value=value)
    batch = pack([Example(s) for s in probe_seqs])
    with torch.no_grad():
        out = engine(batch, logps=True, entropy=True, values=True, temperature=0.7)
        tokens = forward_packed(policy, batch, entropy=True, temperature=0.7)
        assert torch.equal(out.logps, tokens.logps) and torch.equal(out.entropy, tokens.entropy)
        assert torch.equal(out.values, forward_scores(value, batch))
        only = engine(batch, logps=True)
    assert only.entropy is None and only.values is None
    assert isinstance(out, tuple)  # a NamedTuple: FSDP2 registers its backward hooks on these tensors


def test_engine_weighted_logps_carry_the_gradient_of_the_weighted_sum(probe_seqs, pad_id):
    """SFT's path: loss weights in, their weighted log-prob sum out with the gradient the plain sum of
    weighted log-probs has; padded batches (comparison mode) take no weights."""
    policy = load_model("tiny-llama", training=True)
    engine = ModelEngine(policy)
    batch = pack([Example(s) for s in probe_seqs])
    weights = batch.loss_mask[0] * -0.01

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        return torch.autograd.grad(loss, list(policy.parameters()))

    out = engine(batch, logps=True, logp_weights=weights)
    plain = forward_packed(policy, batch).logps
    torch.testing.assert_close(out.logps, plain.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.weighted, (plain * weights).sum(), rtol=1e-6, atol=0)
    for got, want in zip(grads(out.weighted), grads((plain * weights).sum()), strict=True):
        assert (got - want).abs().max() <= 16 * torch.finfo(torch.float32).eps * want.abs().max()
    with pytest.raises(ValueError, match="packed batches only"):
        engine(to_padded(batch, "right", pad_id), logps=True, logp_weights=weights)


def test_score_positions_skip_trailing_pad_like_transformers():
    eos = 2
    batch = pack([Example([5, 6, eos]), Example([7, eos, eos]), Example([8, 9]), Example([eos, eos])])
    # starts at 0, 3, 6, 8: last non-pad token per sequence, or the last token when all are pad
    assert score_positions(batch, eos).tolist() == [1, 3, 7, 9]
    assert score_positions(batch, None).tolist() == [2, 5, 7, 9]


def test_reward_model_with_pad_equal_to_eos_scores_like_transformers():
    """A reward model saved the TRL / transformers way (pad == eos): padless reads the same token as the
    model's own forward, which skips a trailing EOS; reading the last token instead is visibly off."""
    scorer = load_model("tiny-qwen2", task="score", seed=3)
    eos = tiny_tokenizer().eos_token_id
    scorer.config.pad_token_id = eos
    with torch.no_grad():
        scorer.score.weight.mul_(20.0)  # scores of realistic spread
    seqs = [[11, 12, 13, eos], [21, 22, 23, 24, 25, eos], [31, 32, 33]]
    with torch.no_grad():
        alone = torch.stack([scorer(input_ids=torch.tensor([s])).logits[0, 0] for s in seqs])
        got = sequence_scores(ModelEngine(scorer), pack([Example(s) for s in seqs]))
        last = ModelEngine(scorer)(pack([Example(s) for s in seqs]), values=True).values[[3, 9, 12]]
        # A score is a sum of hidden x weight terms that largely cancel: its round-off is relative to the
        # terms' size sum |w| |h| (about 72 here; measured 1.2e-5 = 1.4 eps of it), not to the score's
        hidden = [scorer.model(input_ids=torch.tensor([s])).last_hidden_state[0] for s in seqs]
        terms = max((h.abs() @ scorer.score.weight.abs().T).max().item() for h in hidden)
    torch.testing.assert_close(got, alone, rtol=0, atol=bound(torch.float32, terms))
    assert (last[:2] - alone[:2]).abs().min() > 1e-2


def test_scorer_without_a_pad_in_its_config_gets_its_tokenizers_pad_not_eos(tmp_path):
    tokenizer = tiny_tokenizer()
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    saved = build_tiny_model("tiny-llama", task="score")
    saved.config.pad_token_id = None
    saved.save_pretrained(tmp_path)
    scorer = load_model(str(tmp_path), task="score", pad_id=tokenizer.pad_token_id)
    assert scorer.config.pad_token_id == tokenizer.pad_token_id
    # a tokenizer with no pad of its own: eos, the convention its reward models were trained with
    assert load_model(str(tmp_path), task="score").config.pad_token_id == tokenizer.eos_token_id


def test_packed_text_rows_of_an_m_rope_model_get_rope_rows_and_images_without_them_stop(probe_seqs):
    """An M-RoPE model handed one position row masks the whole packed row causally on sdpa (sequences
    see each other): text rows get their restarting positions as rope rows, rows with images need
    theirs from the rope index."""
    import dataclasses

    from padless.forward.engine import hidden_states
    from padless.proof.check import alone_logps
    from padless.proof.probe import bound

    model = load_model("tiny-qwen2.5-vl", attn_implementation="sdpa")
    batch = pack([Example(s) for s in probe_seqs])
    assert batch.position_ids.dim() == 2
    with torch.no_grad():
        alone = alone_logps(model, probe_seqs)
        packed = [t[:-1] for t in batch.split(forward_packed(model, batch).logps)]
    delta = max((p - a).abs().max().item() for p, a in zip(packed, alone.logps, strict=True))
    assert delta <= bound(torch.float32, alone.magnitude)
    with_image = dataclasses.replace(batch, vision={"pixel_values": torch.zeros(4, 8)})
    with pytest.raises(ValueError, match=r"needs position ids \[4, 1, T\].* with images"):
        hidden_states(model, with_image)


def test_head_takes_the_hidden_states_in_its_own_dtype_as_the_model_does(probe_seqs):
    """Mamba's last norm returns fp32 under a bf16 head; its forward casts before the head, and so must
    padless's (it crashed with 'expected m1 and m2 to have the same dtype' in bf16)."""
    from padless.proof.probe import bound
    from padless.proof.zoo import build_zoo_model

    model = build_zoo_model("mamba", "eager", dtype=torch.bfloat16)
    seq = probe_seqs[1]
    with torch.no_grad():
        got = forward_packed(model, pack([Example(seq)])).logps[:-1]
        own = model(torch.tensor([seq])).logits[0, :-1].float().log_softmax(-1)
    want = own.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    assert (got - want).abs().max() <= bound(torch.bfloat16, own.abs().max().item())


@pytest.mark.parametrize("name", ["deepseek_v32", "minimax", "cohere"])
def test_frontier_architectures_train_packed_as_each_sequence_alone(name, probe_seqs):
    """Indexed sparse attention (DeepSeek-V3.2, the indexer's top-8 keys), lightning attention (MiniMax,
    blocks of 8) and a logit scale (Cohere), logits at |logit| 30, loaded as training loads them (the
    probe proves them): the weight gradient of the packed row's summed log-probs equals the sum over each
    sequence alone, every element within the bound at the size of the largest gradient, and their
    peculiar parts learn (the sparse attention's, the lightning layers', the scaled head's)."""
    from padless.proof.check import zoo_model
    from padless.proof.probe import prove_packing

    model = zoo_model(name, probe_seqs)
    use_backend(model, "varlen")
    prove_packing(model, "varlen")
    model.train()

    def grads(seqs: list[list[int]]) -> dict[str, torch.Tensor]:
        model.zero_grad()
        for batch in seqs:
            forward_packed(model, pack([Example(s) for s in batch])).logps.sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    packed, alone = grads([probe_seqs]), grads([[s] for s in probe_seqs])
    assert packed.keys() == alone.keys()
    peculiar = {"deepseek_v32": "kv_b_proj", "minimax": "qkv_proj", "cohere": "lm_head"}[name]
    assert any(peculiar in n and g.abs().max() > 0 for n, g in packed.items()), peculiar
    limit = bound(torch.float32, max(g.abs().max().item() for g in alone.values()))
    for n, g in packed.items():
        assert (g - alone[n]).abs().max() <= limit, n
