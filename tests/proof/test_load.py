"""Model loading and per-token forwards on packed batches (padless.proof.load)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from padless.forward.attention import attention_in_use
from padless.forward.engine import (
    EngineSettings,
    ModelEngine,
    forward_packed,
    forward_padded,
    forward_scores,
    hidden_states,
    logps_from_hidden,
    score_head,
    sequence_scores,
)
from padless.forward.packing import IGNORE_INDEX, Example, pack, to_padded, unpad
from padless.proof.load import DTYPES, disable_dropout, load_model, load_tokenizer, resolve_dtype
from padless.proof.probe import bound

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


def _packed_logits(model, batch) -> torch.Tensor:
    """Full logits ``[T, V]`` of the packed row through the model's own forward (the head included)."""
    return model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,
        **batch.attention_kwargs(),
    ).logits[0]


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
        _reference([_packed_logits(model, batch)], batch)[0].sum().backward()
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


# ----------------------------------------------------------------------------------------------------------
# The LM head: whole or in chunks, gradient in the forward pass (weights known) or through autograd
# ----------------------------------------------------------------------------------------------------------

HEAD_TOKENS = 200
# name: (model, config attributes the head reads, temperature)
HEAD_CASES = {
    "qwen2 tied": ("tiny-qwen2", {}, 1.0),
    "llama untied": ("tiny-llama", {}, 1.0),
    "temperature": ("tiny-qwen2", {}, 0.7),
    "granite logits_scaling": ("tiny-llama", {"logits_scaling": 4.0}, 1.0),
    "gemma2 final softcap": ("tiny-llama", {"final_logit_softcapping": 30.0}, 1.0),
}


def _head_inputs(model, seed=0, logit_size=30.0):
    """Hidden states ``[T, H]`` scaled so the largest |logit| is ``logit_size`` (before scaling and
    capping: past the soft-cap, which then matters), labels with every fifth position ignored, and
    positive loss weights on the labelled positions."""
    gen = torch.Generator().manual_seed(seed)
    weight = model.get_output_embeddings().weight.detach()
    hidden = torch.randn(HEAD_TOKENS, weight.shape[1], generator=gen)
    scaling = getattr(model.config, "logits_scaling", 1.0)
    hidden *= logit_size * scaling / (hidden @ weight.T).abs().max()
    labels = torch.randint(0, weight.shape[0], (HEAD_TOKENS,), generator=gen)
    labels[::5] = IGNORE_INDEX
    weights = torch.rand(HEAD_TOKENS, generator=gen) * (labels != IGNORE_INDEX)
    return hidden.requires_grad_(), labels, weights


def _full_logits_reference(model, hidden, labels, weights, temperature):
    """Log-probs, entropy and the gradients of ``sum w * logp`` wrt hidden states and head weight, from
    the whole fp32 logits written out as transformers' models compute them."""
    weight = model.get_output_embeddings().weight
    raw = hidden @ weight.T
    logits = raw.float() / getattr(model.config, "logits_scaling", 1.0)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = cap * torch.tanh(logits / cap)
    logp = (logits / temperature).log_softmax(-1)
    keep = labels != IGNORE_INDEX
    picked = logp.gather(-1, labels.clamp(min=0)[:, None])[:, 0] * keep
    entropy = -(logp.exp() * logp).sum(-1) * keep
    *grads, upstream = torch.autograd.grad((picked * weights).sum(), (hidden, weight, raw))
    # a gradient entry sums terms over tokens (weight) or the vocabulary (hidden): the size of those terms
    sizes = [(upstream.abs() @ weight.abs()).max().item(), (upstream.abs().T @ hidden.abs()).max().item()]
    return picked.detach(), entropy.detach(), grads, sizes, logits.abs().max().item()  # |logit| before T


@pytest.mark.parametrize("case", list(HEAD_CASES))
def test_head_whole_chunked_and_fused_equal_full_logits(case):
    """Every way the head runs (whole or in chunks of 7 rows that straddle ignored positions; the fused
    weighted path or autograd) gives the full-logits reference's log-probs, entropy and gradients wrt
    the hidden states and the head weight, at |logit| 30. Bound: 16 eps * the compared values' size
    (padless.proof.probe.bound); measured at most 1.1 eps * |logit| on log-probs and entropy. A gradient
    is built from p = softmax(z / T): a round-off dz in a logit moves p by p dz / T, so its error is
    relative to |z / T| times the size of the terms it sums (|dL/dz| times |W| or |h|): bound 16 eps *
    |z / T| * terms. Measured at most 0.81 eps of that (35 eps of the terms at |z / T| 43, where a 7-row
    chunk's logits round differently from the whole matrix's; 2.8 eps where they round alike)."""
    name, attributes, temperature = HEAD_CASES[case]
    model = load_model(name, training=True)
    for key, value in attributes.items():
        setattr(model.config, key, value)
    hidden, labels, weights = _head_inputs(model)
    want_logps, want_entropy, want_grads, grad_sizes, logit_size = _full_logits_reference(
        model, hidden, labels, weights, temperature
    )
    assert 20 <= logit_size <= 31  # realistic logits, capped or not
    size = logit_size / temperature  # entropy and log-probs are differences of numbers this large
    weight = model.get_output_embeddings().weight
    for chunk in (None, 7):
        for fused in (True, False):
            out = logps_from_hidden(
                model,
                hidden,
                labels,
                entropy=True,
                temperature=temperature,
                chunk_tokens=chunk,
                logp_weights=weights if fused else None,
            )
            loss = out.weighted if fused else (out.logps * weights).sum()
            assert (out.logps.grad_fn is None) == fused  # the fused path's log-probs are values only
            grads = torch.autograd.grad(loss, (hidden, weight))
            where = f"{case}, chunk {chunk}, {'fused' if fused else 'autograd'}"
            assert (out.logps - want_logps).abs().max() <= bound(torch.float32, size), where
            assert (out.entropy - want_entropy).abs().max() <= bound(torch.float32, size), where
            assert (out.logps[labels == IGNORE_INDEX] == 0).all(), where
            assert loss.item() == pytest.approx((want_logps * weights).sum().item(), rel=1e-6), where
            compared = zip(grads, want_grads, grad_sizes, ("hidden", "head weight"), strict=True)
            for got, want, terms, what in compared:
                assert (got - want).abs().max() <= bound(torch.float32, size * terms), (where, what)


def _count_head_matmuls(monkeypatch) -> list[int]:
    """Count the matmuls run from Python: ``F.linear`` (the head's logits, fused or through its module)
    and ``@`` (the fused path's gradients); autograd's own backward matmuls are not Python calls."""
    calls = [0]

    def counted(original):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(F, "linear", counted(F.linear))
    monkeypatch.setattr(torch.Tensor, "__matmul__", counted(torch.Tensor.__matmul__))
    return calls


@pytest.mark.parametrize("fused", [True, False])
def test_head_chunks_only_past_the_memory_budget_and_fused_chunks_run_once(monkeypatch, fused):
    """Whole when the fp32 logits fit the budget (default: small models); past it, chunks of rows that
    fit. The fused path runs each chunk's three matmuls (logits, gradients wrt hidden states and weight)
    in the forward and none in backward; through autograd every chunk's logits are recomputed in
    backward. Without autograd (eval) the fused path computes the logits only."""
    model = load_model("tiny-llama", training=True)
    hidden, labels, weights = _head_inputs(model)
    kept = int((labels != IGNORE_INDEX).sum())  # only labelled positions reach the head
    calls = _count_head_matmuls(monkeypatch)
    budget = {"logits_memory_mb": EngineSettings().logits_memory_mb}

    def matmuls() -> tuple[int, int]:
        calls[0] = 0
        out = logps_from_hidden(model, hidden, labels, logp_weights=weights if fused else None, **budget)
        forward = calls[0]
        (out.weighted if fused else (out.logps * weights).sum()).backward()
        return forward, calls[0] - forward

    def eval_matmuls() -> int:
        calls[0] = 0
        with torch.no_grad():
            logps_from_hidden(model, hidden, labels, logp_weights=weights if fused else None, **budget)
        return calls[0]

    assert matmuls() == ((3, 0) if fused else (1, 0))
    assert eval_matmuls() == 1
    budget_mb = 1  # 64 rows of the 4,096-token vocabulary's fp32 logits
    budget["logits_memory_mb"] = budget_mb
    chunks = -(-kept // 64)
    assert chunks > 1
    assert matmuls() == ((3 * chunks, 0) if fused else (chunks, chunks))
    assert eval_matmuls() == chunks


def test_logits_memory_budget_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        EngineSettings(logits_memory_mb=0)


def test_fused_head_gradient_scales_with_the_upstream_gradient():
    """accelerate divides the loss by the accumulation steps (and fp16 scales it): the saved gradients
    are multiplied by whatever reaches the weighted sum."""
    model = load_model("tiny-qwen2", training=True)
    hidden, labels, weights = _head_inputs(model, seed=1)
    (one,) = torch.autograd.grad(
        logps_from_hidden(model, hidden, labels, logp_weights=weights).weighted, hidden
    )
    scaled = logps_from_hidden(model, hidden, labels, logp_weights=weights).weighted * -0.25
    (quarter,) = torch.autograd.grad(scaled, hidden)
    torch.testing.assert_close(quarter, -0.25 * one, rtol=1e-6, atol=0)


def test_head_without_labels_gives_zeros_and_a_connected_graph():
    model = load_model("tiny-qwen2", training=True)
    hidden, labels, weights = _head_inputs(model)
    labels = torch.full_like(labels, IGNORE_INDEX)
    for given in (weights, None):
        out = logps_from_hidden(model, hidden, labels, entropy=True, logp_weights=given)
        assert (out.logps == 0).all() and (out.entropy == 0).all()
        loss = out.weighted if given is not None else out.logps.sum()
        (grad,) = torch.autograd.grad(loss, hidden)
        assert (grad == 0).all()


def test_fused_head_under_bf16_autocast_matches_autograd():
    """Under bf16 autocast both paths run the head's matmuls in bf16 (the gradients' too) and the
    log-softmax in fp32: they agree to bf16 round-off of the compared values."""
    model = load_model("tiny-qwen2", training=True)
    hidden, labels, weights = _head_inputs(model, seed=2)
    weight = model.get_output_embeddings().weight
    results = []
    for fused in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = logps_from_hidden(
                model, hidden, labels, chunk_tokens=64, logp_weights=weights if fused else None
            )
            loss = out.weighted if fused else (out.logps * weights).sum()
        results.append((out.logps.detach(), torch.autograd.grad(loss, (hidden, weight))))
    (fused_logps, fused_grads), (plain_logps, plain_grads) = results
    assert (fused_logps - plain_logps).abs().max() <= bound(torch.float32, plain_logps.abs().max())
    for got, want in zip(fused_grads, plain_grads, strict=True):
        assert got.dtype == want.dtype == torch.float32
        assert (got - want).abs().max() <= bound(torch.bfloat16, want.abs().max())


def test_lora_on_the_head_runs_through_autograd_with_the_same_numbers(examples):
    """A LoRA-wrapped head is not a plain Linear: the weighted sum goes through autograd, chunked or
    whole, and equals full logits through the model's own forward, gradients of the adapters included."""
    model = load_model("tiny-llama", training=True)
    lora = LoraConfig(r=4, target_modules=["lm_head", "q_proj"], init_lora_weights=False)
    model = get_peft_model(model, lora)
    batch = pack(examples)
    keep = batch.loss_mask[0]
    weights = keep / keep.sum()
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    assert any("lm_head" in n for n, p in model.named_parameters() if "lora_" in n)

    def run(chunk):
        out = forward_packed(model, batch, chunk_tokens=chunk, logp_weights=weights)
        assert out.logps.grad_fn is not None  # not the fused path: its log-probs carry the graph
        return out.logps.detach(), torch.autograd.grad(out.weighted, adapters)

    logits = _packed_logits(model, batch)
    labels = batch.labels[0]
    want = logits.float().log_softmax(-1).gather(-1, labels.clamp(min=0)[:, None])[:, 0] * keep
    want_grads = torch.autograd.grad((want * weights).sum(), adapters)
    for chunk in (None, CHUNK):
        logps, grads = run(chunk)
        assert (logps - want.detach()).abs().max() <= bound(torch.float32, want.abs().max())
        for got, ref in zip(grads, want_grads, strict=True):
            assert (got - ref).abs().max() <= bound(torch.float32, ref.abs().max())


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
