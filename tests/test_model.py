"""Model loading and per-token forwards on packed batches (padless.model)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from padless.attention import attention_in_use
from padless.engine import ModelEngine, sequence_scores
from padless.model import (
    DTYPES,
    disable_dropout,
    forward_packed,
    forward_padded,
    forward_scores,
    hidden_states,
    load_model,
    load_tokenizer,
    resolve_dtype,
    score_head,
)
from padless.packing import IGNORE_INDEX, Example, pack, to_padded, unpad

FP32_TOL = 1e-5
CHUNK = 7  # does not divide any sequence length or the total: chunks straddle sequence boundaries


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-qwen2", attn_implementation="varlen")


@pytest.fixture(scope="module")
def examples(probe_seqs) -> list[Example]:
    """The probe sequences; the 20-token one trains only on its second half."""
    short, mid, long = probe_seqs
    return [Example(short), Example(mid, loss_mask=[False] * 10 + [True] * 10), Example(long)]


@pytest.fixture(scope="module")
def full_logits(lm, examples) -> list[torch.Tensor]:
    """Plain full logits ``[L_i, V]`` of each sequence run alone (no packing, no chunking), fp32."""
    with torch.no_grad():
        return [lm(input_ids=torch.tensor(ex.input_ids)[None], use_cache=False).logits[0] for ex in examples]


def _reference(full_logits, batch, temperature=1.0):
    """Per-token log-probs and entropy ``[T]`` of ``batch.labels`` from full log_softmax; 0 where ignored."""
    logp = torch.cat(full_logits).float().div(temperature).log_softmax(-1)
    labels = batch.labels[0]
    keep = labels != IGNORE_INDEX
    picked = logp.gather(-1, labels.clamp(min=0)[:, None])[:, 0] * keep
    entropy = -(logp.exp() * logp).sum(-1) * keep
    return picked, entropy


@pytest.mark.parametrize("chunk_tokens", [None, CHUNK, 1])
def test_forward_packed_logps_and_entropy(lm, examples, full_logits, chunk_tokens):
    batch = pack(examples)
    with torch.no_grad():
        out = forward_packed(lm, batch, entropy=True, chunk_tokens=chunk_tokens)
    want_logps, want_entropy = _reference(full_logits, batch)
    assert out.logps.shape == out.entropy.shape == (batch.num_tokens,)
    assert out.logps.dtype == torch.float32
    torch.testing.assert_close(out.logps, want_logps, rtol=0, atol=FP32_TOL)
    torch.testing.assert_close(out.entropy, want_entropy, rtol=0, atol=FP32_TOL)
    # Exactly zero where nothing is trained (sequence ends, the masked half of the middle sequence).
    ignored = batch.labels[0] == IGNORE_INDEX
    assert int(ignored.sum()) == 3 + 9  # three sequence ends; targets 1..9 of the middle sequence
    assert (out.logps[ignored] == 0).all() and (out.entropy[ignored] == 0).all()
    assert (out.logps[~ignored] < 0).all() and (out.entropy[~ignored] > 0).all()


def test_forward_packed_without_entropy(lm, examples):
    with torch.no_grad():
        out = forward_packed(lm, pack(examples))
    assert out.entropy is None


def test_forward_packed_temperature(lm, examples, full_logits):
    batch = pack(examples)
    with torch.no_grad():
        out = forward_packed(lm, batch, temperature=0.7, chunk_tokens=CHUNK)
        plain = forward_packed(lm, batch)
    want, _ = _reference(full_logits, batch, temperature=0.7)
    torch.testing.assert_close(out.logps, want, rtol=0, atol=FP32_TOL)
    assert (out.logps - plain.logps).abs().max() > 1e-2  # the temperature is applied at all


def test_chunked_gradients_match_unchunked(examples):
    model = load_model("tiny-qwen2", attn_implementation="varlen", training=True)
    batch = pack(examples)

    def grads(chunk_tokens):
        model.zero_grad(set_to_none=True)
        forward_packed(model, batch, chunk_tokens=chunk_tokens).logps.sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    def plain_grads():
        model.zero_grad(set_to_none=True)
        logits = model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=False,
            **batch.attention_kwargs(),
        ).logits[0]
        labels = batch.labels[0]
        keep = labels != IGNORE_INDEX
        (logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[:, None])[:, 0] * keep).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    whole, chunked, plain = grads(None), grads(CHUNK), plain_grads()
    assert whole.keys() == chunked.keys() == plain.keys()
    assert len(whole) == len(list(model.parameters()))
    for name in whole:
        # Relative to the tensor's largest entry (entries near zero carry fp32 round-off of the big ones).
        scale = whole[name].abs().max().item()
        assert scale > 0, f"{name}: no gradient reached it"
        for other, label in ((chunked, "chunked"), (plain, "plain")):
            rel = (other[name] - whole[name]).abs().max().item() / scale
            assert rel <= 1e-5, f"{name}: {label} gradient differs by {rel:.2g} of its scale"


@pytest.mark.parametrize("side", ["left", "right"])
def test_forward_padded_matches_packed(lm, examples, full_logits, pad_id, side):
    batch = pack(examples)
    padded = to_padded(batch, side, pad_id)
    with torch.no_grad():
        logps = forward_padded(lm, padded)
    assert logps.shape == padded.input_ids.shape
    assert (logps[padded.attention_mask == 0] == 0).all()
    want, _ = _reference(full_logits, batch)
    torch.testing.assert_close(unpad(logps, padded.attention_mask), want, rtol=0, atol=FP32_TOL)


def test_hidden_states_shape(lm, examples):
    batch = pack(examples)
    with torch.no_grad():
        hidden = hidden_states(lm, batch)
    assert hidden.shape == (1, batch.num_tokens, lm.config.hidden_size)


# ----------------------------------------------------------------------------------------------------------
# Scalar heads: reward and value models
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-llama"])
def scorer(request):
    return load_model(request.param, task="score", attn_implementation="varlen")


@pytest.fixture(scope="module")
def alone_scores(scorer, probe_seqs) -> torch.Tensor:
    """Each sequence scored alone by the model's own HF forward (which reads the last non-pad token)."""
    assert all(scorer.config.pad_token_id not in s for s in probe_seqs)
    with torch.no_grad():
        return torch.stack(
            [scorer(input_ids=torch.tensor(s)[None], use_cache=False).logits[0, 0] for s in probe_seqs]
        )


def test_sequence_scores_match_alone(scorer, probe_seqs, alone_scores):
    with torch.no_grad():
        scores = sequence_scores(ModelEngine(scorer), pack([Example(s) for s in probe_seqs]))
    assert scores.shape == (len(probe_seqs),)
    torch.testing.assert_close(scores, alone_scores, rtol=0, atol=FP32_TOL)
    assert (alone_scores.max() - alone_scores.min()) > 1e-3  # distinct sequences, distinct scores


@pytest.mark.parametrize("order", [[2, 0, 1], [1, 2], [0], [2, 1, 0, 2]])
def test_sequence_scores_invariant_to_batch_composition(scorer, probe_seqs, alone_scores, order):
    with torch.no_grad():
        scores = sequence_scores(ModelEngine(scorer), pack([Example(probe_seqs[i]) for i in order]))
    torch.testing.assert_close(scores, alone_scores[order], rtol=0, atol=FP32_TOL)


def test_forward_scores_per_token(scorer, probe_seqs):
    batch = pack([Example(s) for s in probe_seqs])
    with torch.no_grad():
        per_token = forward_scores(scorer, batch)
        alone = torch.cat(
            [
                scorer.get_decoder()(input_ids=torch.tensor(s)[None], use_cache=False).last_hidden_state[0]
                for s in probe_seqs
            ]
        )
        want = score_head(scorer)(alone)[:, 0]
    assert per_token.shape == (batch.num_tokens,)
    torch.testing.assert_close(per_token, want, rtol=0, atol=FP32_TOL)


def test_score_head_missing_on_causal_lm(lm):
    with pytest.raises(ValueError, match="no scalar head"):
        score_head(lm)


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------


def test_load_model_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        load_model("tiny-qwen2", dtype="fp8")


def test_resolve_dtype():
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    assert set(DTYPES) == {"float32", "bfloat16", "float16"}


def test_load_model_dtype_and_mode():
    model = load_model("tiny-llama", dtype="bfloat16", training=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.training


def test_load_model_is_deterministic_and_gives_each_model_its_own_config():
    a = load_model("tiny-qwen2", attn_implementation="varlen", seed=3)
    b = load_model("tiny-qwen2", attn_implementation="eager", seed=3)
    c = load_model("tiny-qwen2", attn_implementation="varlen", seed=4)
    assert a.config is not b.config
    assert attention_in_use(a) == "varlen" and attention_in_use(b) == "eager"
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_load_tokenizer_embedded():
    tok = load_tokenizer("tiny-qwen2")
    assert tok.pad_token_id == 0 and len(tok) == 4096


def test_disable_dropout_makes_training_forwards_repeatable():
    model = load_model("tiny-llama", attn_implementation="eager")  # eager applies attention dropout
    model.config.attention_dropout = 0.3
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.3
    lora = LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.5, init_lora_weights=False)
    model = get_peft_model(model, lora).train()
    batch = pack([Example(list(range(3, 40)))])

    def twice() -> tuple[torch.Tensor, torch.Tensor]:
        return forward_packed(model, batch).logps, forward_packed(model, batch).logps

    first, second = twice()
    assert not torch.equal(first, second)
    layers = model.config.num_hidden_layers
    assert disable_dropout(model) == 2 * layers  # per layer: attention dropout, LoRA dropout on q_proj
    first, second = twice()
    assert torch.equal(first, second)
    assert disable_dropout(model) == 0
