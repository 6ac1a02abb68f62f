"""The load-time probe: the requested kernel runs, and it isolates packed sequences; its round-off bound; its
proof reused within a process only where the model, the backend and the code that runs are the same."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

import padless.forward.varlen as varlen
import padless.proof.probe as probe
from padless.cli import main
from padless.errors import describe, exit_code
from padless.forward.attention import (
    VARLEN_NAME,
    AttentionError,
    assert_attention,
    attention_in_use,
)
from padless.forward.engine import LogitsHead, forward_packed
from padless.forward.packing import Example, pack
from padless.forward.varlen import (
    KERNEL_CALLS,
    varlen_attention_forward,
)
from padless.proof.check import layout_logps, max_delta, run_matrix
from padless.proof.load import load_model
from padless.proof.probe import (
    FORMULA,
    ROUNDING_FACTOR,
    bound,
    count_attention_calls,
    probe_attention,
)
from padless.tiny import tiny_config, tiny_tokenizer

# ----------------------------------------------------------------------------------------------------------
# The probe: the requested kernel runs, and it isolates packed sequences
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "kernel"), [("varlen", "sdpa"), ("sdpa", "sdpa"), ("eager", "eager")])
def test_probe_passes_and_reports_kernel(models, backend, kernel):
    info = probe_attention(models[backend], backend)
    assert info["backend"] == backend
    assert info["kernel"] == kernel
    assert 0.0 <= info["max_delta_logps"] <= info["bound"] < 1e-4  # fp32 round-off, far from a leak
    assert info["max_delta_hidden"] < 1e-4 and info["lengths"] == [4, 19, 77, 160]


@pytest.mark.parametrize("backend", ["varlen", "sdpa"])
def test_probe_reports_one_call_per_layer(models, backend):
    info = probe_attention(models[backend], backend)
    assert info["calls"] == models[backend].config.num_hidden_layers


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_packed_forward_calls_varlen_once_per_layer(name, probe_seqs):
    model = load_model(name, attn_implementation="varlen")
    layers = model.config.num_hidden_layers
    before = KERNEL_CALLS["varlen:sdpa"]
    with torch.no_grad(), count_attention_calls() as counts:
        forward_packed(model, pack([Example(s) for s in probe_seqs]))
    assert dict(counts) == {VARLEN_NAME: layers}
    assert KERNEL_CALLS["varlen:sdpa"] - before == layers
    # The counting wrappers are removed afterwards.
    assert ALL_ATTENTION_FUNCTIONS[VARLEN_NAME] is varlen_attention_forward


def test_shared_config_switch_is_caught(probe_seqs):
    cfg = tiny_config("tiny-qwen2")
    first = AutoModelForCausalLM.from_config(cfg, attn_implementation=VARLEN_NAME)
    first.padless_attention = "varlen"
    assert_attention(first, "varlen")
    AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")  # same config object
    assert attention_in_use(first) == "eager", "precondition: transformers writes the kernel into cfg"
    with pytest.raises(AttentionError, match="same config object"):
        assert_attention(first, "varlen")
    with pytest.raises(AttentionError, match="same config object"):
        forward_packed(first, pack([Example(s) for s in probe_seqs]))
    with pytest.raises(AttentionError, match="same config object"):
        probe_attention(first, "varlen")


def test_config_mismatch_raises(monkeypatch, probe_seqs):
    model = load_model("tiny-qwen2", attn_implementation="varlen")
    assert model.padless_attention == "varlen"
    monkeypatch.setattr(model.config, "_attn_implementation", "sdpa")
    with pytest.raises(AttentionError, match=r"loaded with attention 'varlen'.*dispatches to 'sdpa'"):
        forward_packed(model, pack([Example(s) for s in probe_seqs]))
    with pytest.raises(AttentionError, match="dispatches to 'sdpa'"):
        assert_attention(model, "varlen")


def test_probe_catches_a_layer_running_another_kernel():
    model = load_model("tiny-qwen2", attn_implementation="varlen")
    layer = model.model.layers[1].self_attn
    layer.config = copy.deepcopy(layer.config)
    layer.config._attn_implementation = "sdpa"
    assert attention_in_use(model) == "varlen"  # the top-level config still says varlen
    with pytest.raises(AttentionError, match=r"requested attention 'varlen' but a packed forward called"):
        probe_attention(model, "varlen")


def test_probe_reference_runs_on_eager_and_every_config_is_restored():
    """The probe's reference runs on transformers' eager kernel; afterwards each config (here one layer
    holding a config of its own) dispatches exactly where it did before."""
    model = load_model("tiny-qwen2", attn_implementation="varlen")
    layer = model.model.layers[1].self_attn
    layer.config = copy.deepcopy(layer.config)
    layer.config._attn_implementation = "sdpa"
    with probe._eager(model), count_attention_calls() as calls, torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
    assert dict(calls) == {}  # eager is the built-in default: no registered function ran
    assert model.config._attn_implementation == VARLEN_NAME and layer.config._attn_implementation == "sdpa"


def _leaky_varlen(module, query, key, value, attention_mask, **kwargs):
    """The varlen function with the sequence boundaries dropped: one causal attention over the whole row."""
    for k in ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids"):
        kwargs.pop(k, None)
    return varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_probe_catches_a_leaking_kernel(monkeypatch):
    model = load_model("tiny-qwen2", attn_implementation="varlen")
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, VARLEN_NAME, _leaky_varlen)
    with pytest.raises(AttentionError, match="leaks between packed sequences"):
        probe_attention(model, "varlen")
    with pytest.raises(AttentionError, match="leaks between packed sequences"):
        load_model("tiny-qwen2", attn_implementation="varlen")


def _bf16_moe(probe_seqs):
    """Tiny DeepSeek-V3 in bf16, logits of realistic size, on varlen: round-off flips expert routing."""
    from padless.proof.check import use_backend, zoo_model

    model = zoo_model("deepseek-v3", probe_seqs, torch.bfloat16)
    use_backend(model, "varlen")
    return model


def test_a_bf16_moe_whose_round_off_flips_routing_is_proven_in_float32_on_the_same_weights(probe_seqs):
    model = _bf16_moe(probe_seqs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AttentionError, match=r"by (\d+\.?\d*) > bound"):  # 16 bits alone: over the bound
        probe_attention(model, "varlen")
    info = probe.prove_packing(model, "varlen")
    assert info["max_delta_logps"] <= info["bound"] < 1e-3  # float32 round-off: the layout is exact
    assert "differ from the model's own forward" in info["float32_reprobe"]  # the 16-bit figure is kept
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def test_a_bf16_leak_is_refused_in_float32_too(probe_seqs, monkeypatch):
    model = _bf16_moe(probe_seqs)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, VARLEN_NAME, _leaky_varlen)
    with pytest.raises(AttentionError, match=r"the same probe in float32 fails too: .*leaks between packed"):
        probe.prove_packing(model, "varlen")
    assert next(model.parameters()).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------------------
# The model's own forward is the reference: a logits transform padless has no name for is refused
# ----------------------------------------------------------------------------------------------------------

GAIN = 0.5  # what the model below multiplies its logits by, under a name padless does not know


class GainedConfig(Qwen2Config):
    model_type = "padless_test_gained"


class GainedForCausalLM(Qwen2ForCausalLM):
    """Qwen2 whose forward scales its logits by ``config.output_gain``, after the LM head: a transform
    that no list of names in padless covers (as Cohere's ``logit_scale`` once was not)."""

    config_class = GainedConfig

    def forward(self, *args, labels=None, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.config.output_gain
        if labels is not None:  # its own loss is on the logits it returns
            out.loss = self.loss_function(out.logits, labels, self.config.vocab_size)
        return out


@pytest.fixture(scope="module")
def gained_folder(tmp_path_factory) -> Path:
    """A tiny model folder of that architecture, registered with transformers' auto classes."""
    AutoConfig.register(GainedConfig.model_type, GainedConfig, exist_ok=True)
    AutoModelForCausalLM.register(GainedConfig, GainedForCausalLM, exist_ok=True)
    config = GainedConfig(**tiny_config("tiny-qwen2").to_dict())
    config.output_gain = GAIN
    folder = tmp_path_factory.mktemp("gained")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        GainedForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_a_logits_transform_padless_has_no_name_for_is_refused_by_sft(gained_folder, tmp_path, capsys):
    """`padless sft` stops at load with exit 2 and one line that gives the measured difference."""
    run = ["data.train=tiny:sft_eval", "train.max_steps=1", "train.progress_bar=false"]
    code = main(["sft", f"model.name={gained_folder}", *run, f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("padless sft: error: GainedForCausalLM"), err
    match = re.search(
        r"differ from the model's own forward on each sequence alone \(eager\) "
        r"by ([\d.e+-]+) > bound ([\d.e+-]+)",
        err,
    )
    assert match, err
    assert float(match[1]) > 0.1 > 1e3 * float(match[2])  # halved logits: far past fp32 round-off
    assert "hidden states its LM head reads agree" in err and "no name for" in err
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def test_the_same_model_passes_once_padless_reproduces_its_transform(gained_folder, monkeypatch):
    """The proof depends on no list: taught the transform (Granite's ``logits_scaling`` divides), the
    head computes the model's own numbers and the probe passes on every head path."""
    of = LogitsHead.of.__func__

    def reproducing(cls, model, temperature=1.0):
        head = of(cls, model, temperature)
        return dataclasses.replace(head, scaling=1 / model.config.output_gain)

    monkeypatch.setattr(LogitsHead, "of", classmethod(reproducing))
    model = load_model(str(gained_folder))
    info = model.padless_probe
    assert info["max_delta_logps"] <= info["bound"] < 1e-4
    assert info["lengths"] == [4, 19, 77, 160]


class ZLossForCausalLM(Qwen2ForCausalLM):
    """Qwen2 whose own loss adds a z-loss on its logits (as Bamba's ``z_loss_coefficient`` does): a term of
    its objective that leaves its logits, and so every per-token log-prob, as they are."""

    def forward(self, *args, labels=None, **kwargs):
        out = super().forward(*args, labels=labels, **kwargs)
        if labels is not None:
            out.loss = out.loss + 1e-3 * out.logits.float().logsumexp(-1).pow(2).mean()
        return out


def test_a_term_the_models_own_loss_adds_is_refused(models):
    """The probe compares padless's loss on each sequence alone with the model's own
    ``forward(labels=...).loss``: the same weights pass as Qwen2 and are refused with the term."""
    plain = models["varlen"]
    assert probe_attention(plain, "varlen")["max_delta_loss"] < 1e-5
    planted = ZLossForCausalLM(plain.config)
    planted.load_state_dict(plain.state_dict())
    planted.padless_attention = "varlen"
    with pytest.raises(AttentionError, match="its own loss for labels is not padless's"):
        probe_attention(planted, "varlen")


def test_check_shows_the_packed_cell_off_and_the_probe_refuses_varlen(gained_folder, probe_seqs, pad_id):
    """`padless check`'s packed cell (padless's head) is off by the transform's effect; varlen, the backend
    training would run, is refused by the probe with the same measurement: check fails => training refuses."""
    model = load_model(str(gained_folder), probe=False)
    rows, _ = run_matrix(model, probe_seqs, pad_id, ("varlen", "sdpa"))
    for row in rows:
        assert row.refused is not None and "does not reproduce" in row.refused, row
    model.set_attn_implementation(VARLEN_NAME)
    model.padless_attention = "varlen"
    with torch.no_grad():
        packed = layout_logps(model, probe_seqs, "packed", pad_id)
        alone = layout_logps(model, probe_seqs, "alone", pad_id)
    assert max_delta(packed, alone) > 0.1


def test_a_failing_reference_forward_names_architecture_backend_and_transformers(monkeypatch):
    """A failure inside transformers' own forward is said to be one, with the architecture and backend."""
    model = load_model("tiny-qwen2", attn_implementation="sdpa", probe=False)

    def broken(self, *args, **kwargs):
        raise RuntimeError("The size of tensor a (4) must match the size of tensor b (8)")

    layer = model.model.layers[0].self_attn
    monkeypatch.setattr(type(layer), "forward", broken)
    with pytest.raises(probe.ReferenceForwardError) as caught:
        probe_attention(model, "sdpa")
    message = str(caught.value)
    assert "Qwen2ForCausalLM (qwen2)" in message and "'sdpa'" in message
    assert "transformers' own forward failed" in message and "size of tensor a (4)" in message
    assert "unexpected" not in describe(caught.value) and exit_code(caught.value) == 2


def test_probe_lengths_cover_the_check_and_grow_past_windows_and_chunks():
    qwen = tiny_config("tiny-qwen2")
    assert probe.probe_lengths(qwen) == (4, 19, 77, 160)
    qwen.sliding_window = 300
    assert probe.probe_lengths(qwen)[-1] == 303
    qwen.sliding_window = 100_000
    assert probe.probe_lengths(qwen)[-1] == probe.PROBE_MAX_LENGTH


# ----------------------------------------------------------------------------------------------------------
# Llama 4: chunked attention and query temperature, proved on the model's own forward
# ----------------------------------------------------------------------------------------------------------


def _llama4(chunk: int, floor_scale: int):
    """The zoo's tiny Llama 4 text model on varlen with the given chunk size and temperature floor."""
    from padless.forward.engine import use_backend
    from padless.proof.zoo import zoo_config

    config = zoo_config("llama4_text")
    config.attention_chunk_size, config.floor_scale = chunk, floor_scale
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    use_backend(model, "varlen")
    return model


def test_llama4_spans_longer_than_the_probe_are_cut_while_it_runs_and_restored():
    """Llama 4's real chunks and temperature floor (8192 tokens) are longer than the probe's sequences: the
    probe cuts them so its sequences cross them, proves the layout there, says so, and restores them."""
    model = _llama4(8192, 8192)
    info = probe_attention(model, "varlen")
    assert info["spans_cut"] == {"attention_chunk_size": (8192, 16), "floor_scale": (8192, 64)}
    assert info["max_delta_logps"] <= info["bound"] and info["lengths"] == [4, 19, 77, 160]
    assert model.config.attention_chunk_size == 8192 and model.config.floor_scale == 8192
    assert all(layer.self_attn.floor_scale == 8192 for layer in model.model.layers)


@pytest.mark.parametrize(
    ("planted", "replacement"),
    [("attention_chunk", lambda module: None), ("_query_temperature_per_sequence", lambda m, q, s: q)],
)
def test_llama4_planted_leak_fails_the_probe(planted, replacement, monkeypatch):
    """Chunks that run across sequence boundaries (a chunk of the row, not of each sequence), or queries
    scaled by their place in the row: the probe refuses either at Llama 4's own sizes (which it cuts)."""
    import padless.forward.varlen as varlen

    monkeypatch.setattr(varlen, planted, replacement)
    with pytest.raises(AttentionError, match="leaks between packed sequences"):
        probe_attention(_llama4(8192, 8192), "varlen")


def test_llama4_temperature_tuning_is_refused_where_only_varlen_corrects_it():
    from padless.forward.sequence_parallel import SequenceParallelError, check_model

    model = _llama4(8, 32)
    model.set_attn_implementation("sdpa")
    with pytest.raises(AttentionError, match="NoPE layers by each token's place in the whole row"):
        assert_attention(model, "sdpa")
    with pytest.raises(SequenceParallelError, match="under sequence parallelism"):
        check_model(_llama4(8, 32), 2)


def test_the_tree_layout_is_proven_where_it_runs():
    """probe_attention(tree=True): branches sharing nested prefixes, run as a tree row, equal each sequence
    alone (hidden states and log-probs); the run log's probe line carries it."""
    model = load_model("tiny-llama", probe=False)
    info = probe_attention(model, "varlen", tree=True)["tree"]
    assert info["max_delta_logps"] <= info["bound"] and info["tokens"] < info["flat_tokens"]


def test_a_sibling_leak_fails_the_tree_probe(sibling_leak):
    with pytest.raises(AttentionError, match="tree packing on 'varlen' is not exact"):
        probe_attention(load_model("tiny-llama", probe=False), "varlen", tree=True)


# ----------------------------------------------------------------------------------------------------------
# The bound on per-token differences: the dtype's epsilon times the size of what is compared
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bound_scales_with_epsilon_and_magnitude(dtype):
    eps = torch.finfo(dtype).eps
    assert bound(dtype, 30.0) == pytest.approx(ROUNDING_FACTOR * eps * 30.0)
    assert bound(dtype, 60.0) == pytest.approx(2 * bound(dtype, 30.0))
    # Below 1 the bound stays at 16 eps: a difference is never known more precisely than eps itself.
    assert bound(dtype, 0.01) == bound(dtype, 1.0) == pytest.approx(ROUNDING_FACTOR * eps)


def test_bound_values_where_real_models_live():
    # |logit| 30: fp32 allows 5.7e-5 (contamination moves log-probs by 1e-2 and more) ...
    assert bound(torch.float32, 30.0) == pytest.approx(5.72e-5, rel=1e-2)
    # ... while bf16 round-off alone reaches a nat there: one bf16 ulp of 30 is 0.125.
    assert bound(torch.bfloat16, 30.0) == pytest.approx(3.75)


def test_docs_state_the_formula_in_use():
    page = (Path(__file__).resolve().parents[2] / "docs" / "proof.md").read_text()
    assert f"bound = {ROUNDING_FACTOR:g} · eps(dtype) · max(M, 1)" in page
    assert FORMULA.startswith(f"bound = {ROUNDING_FACTOR:g} * eps(dtype) * max(M, 1)")


# ----------------------------------------------------------------------------------------------------------
# The proof reused within a process only where everything it proved is the same: a changed kernel, library
# function or weight is proven again, and a broken one refused
# ----------------------------------------------------------------------------------------------------------


def _proof(model: torch.nn.Module) -> dict:
    return {k: v for k, v in model.padless_probe.items() if k != "reused"}


def test_an_identical_load_reuses_the_proof_and_runs_no_forward():
    first = load_model("tiny-llama")
    before = Counter(KERNEL_CALLS)
    second = load_model("tiny-llama", training=True)  # the probe runs in eval mode either way
    assert second.padless_probe["reused"] is True and _proof(second) == _proof(first)
    assert before == KERNEL_CALLS  # no forward ran
    assert "reused" not in load_model("tiny-llama", seed=1).padless_probe  # other weights: proven


def _counted(fn, calls: list[str]):
    def wrapper(*args, **kwargs):
        calls.append(fn.__name__)
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize(
    ("owner", "name"),
    [
        (F, "scaled_dot_product_attention"),  # torch, under padless's varlen kernel
        (modeling_llama, "apply_rotary_pos_emb"),  # the model's own modeling code
        (varlen, "_grouped_causal"),  # padless
    ],
)
def test_a_replaced_function_is_proven_again(owner, name, monkeypatch):
    """The same model as a proven one, with one function the probe runs replaced (by a counting wrapper):
    the proof is not reused, the probe runs through the replacement."""
    load_model("tiny-llama")
    calls: list[str] = []
    monkeypatch.setattr(owner, name, _counted(getattr(owner, name), calls))
    model = load_model("tiny-llama")
    assert "reused" not in model.padless_probe and calls


def test_a_kernel_broken_after_an_identical_model_was_proven_is_refused(monkeypatch):
    load_model("tiny-llama")
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, VARLEN_NAME, _leaky_varlen)
    with pytest.raises(AttentionError, match="leaks between packed sequences"):
        load_model("tiny-llama")
