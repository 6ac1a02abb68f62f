"""The architecture matrix: every zoo architecture, alone / left / right / packed, on every CPU backend
that accepts it, per token against each sequence alone on eager, within the scaled bound; or refused
with its reason. Logits are scaled to |logit| 30, where real models live and round-off is largest.

(flex_attention compiles one kernel per shape on CPU, minutes for the zoo: it runs in test_check.py on
the embedded models and in ``padless check --zoo --backends flex_attention``.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from padless.attention import VARLEN_NAME
from padless.check import (
    LAYOUTS,
    ZooResult,
    alone_logps,
    format_zoo,
    layout_logps,
    max_delta,
    probe_sequences,
    run_matrix,
    run_zoo,
    zoo_model,
)
from padless.tolerance import bound
from padless.varlen import varlen_attention_forward
from padless.zoo import LOGIT_TARGET, ZOO, build_zoo_model, zoo_config

BACKENDS = ("varlen", "sdpa", "eager")
SDPA_UNSUPPORTED = (
    "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention"
)
# (architecture, backend) -> what its refusal says. Anything else must run and be exact.
REFUSALS = {
    ("gemma2", "sdpa"): SDPA_UNSUPPORTED,  # transformers refuses: sdpa has no soft-cap
    ("gpt-oss", "sdpa"): SDPA_UNSUPPORTED,  # transformers refuses: sdpa has no sinks
    # transformers 5.23 builds gpt-oss's masks without position_ids, so eager cannot see packed boundaries:
    # the load-time probe measures the leak and refuses.
    ("gpt-oss", "eager"): "leaks between packed sequences",
    **{("qwen3-next", b): "has linear_attention layers" for b in BACKENDS},
}
CAPPED = {"gemma2"}  # a final logit soft-cap of 30 keeps |logit| below 30


def test_zoo_covers_the_architectures_the_issue_lists():
    assert {
        "llama3",
        "qwen2",
        "qwen3",
        "qwen3-moe",
        "mistral",
        "gemma2",
        "gemma3",
        "phi3",
        "olmo2",
        "smollm3",
        "granite",
        "gpt-oss",
        "deepseek-v3",
        "qwen3-next",
    } <= set(ZOO)
    for name in ZOO:
        config = zoo_config(name)
        assert config.hidden_size == 64 and config.num_hidden_layers == 2 and config.vocab_size == 4096
        assert zoo_config(name) is not config  # fresh each time: transformers writes into configs
    with pytest.raises(ValueError, match="unknown zoo architecture 'llama2'"):
        zoo_config("llama2")


def test_zoo_configs_exercise_what_they_claim():
    assert zoo_config("mistral").sliding_window == 8
    assert zoo_config("gemma2").attn_logit_softcapping == 2.0
    gpt_oss = build_zoo_model("gpt-oss", "eager")
    assert gpt_oss.model.layers[0].self_attn.sinks.abs().max() > 0.05  # learned sinks, not zeros
    deepseek = zoo_config("deepseek-v3")
    assert deepseek.qk_nope_head_dim + deepseek.qk_rope_head_dim == 24 and deepseek.v_head_dim == 8
    bidirectional = build_zoo_model("gemma3-bidirectional", "eager")
    assert not any(layer.self_attn.is_causal for layer in bidirectional.model.layers)
    assert "linear_attention" in zoo_config("qwen3-next").layer_types


@pytest.fixture(scope="module")
def zoo_seqs(tokenizer) -> list[list[int]]:
    """The sequences `padless check --zoo` runs (lengths 4 to 160), so README's table can be compared."""
    return probe_sequences(tokenizer)


@pytest.fixture(scope="module")
def zoo_results(zoo_seqs, pad_id) -> dict[str, ZooResult]:
    """The whole matrix, computed once for the module (about 10 s on one core)."""
    return {z.name: z for z in run_zoo(zoo_seqs, pad_id, BACKENDS)}


@pytest.mark.parametrize("name", list(ZOO))
def test_logits_are_scaled_to_realistic_size(name, zoo_seqs):
    with torch.no_grad():
        reference = alone_logps(zoo_model(name, zoo_seqs), zoo_seqs)
    if name in CAPPED:
        assert 20 < reference.max_logit < LOGIT_TARGET
    else:
        assert reference.max_logit == pytest.approx(LOGIT_TARGET, rel=1e-4)
    assert reference.max_logp > 20  # log-probs as far from zero as real models put unlikely tokens


@pytest.mark.parametrize("name", list(ZOO))
def test_architecture_matrix(name, zoo_results):
    result = zoo_results[name]
    assert result.bound >= bound(torch.float32, 20.0)  # the bound of realistic logits
    assert [r.backend for r in result.rows] == list(BACKENDS)
    for row in result.rows:
        refusal = REFUSALS.get((name, row.backend))
        if refusal:
            assert row.refused is not None and refusal in row.refused, row
            assert row.cells == []
            continue
        assert row.ran, row.refused
        assert row.kernel == ("eager" if row.backend == "eager" else "sdpa")
        assert [c.layout for c in row.cells] == list(LAYOUTS)
        for cell in row.cells:
            assert cell.error is None, cell.error
            assert cell.bound == result.bound
            assert cell.max_delta <= cell.bound, (
                f"{name} / {row.backend} / {cell.layout}: {cell.max_delta:.3g}"
            )


def _dropping(key: str, replacement: object = None):
    """The varlen function with one argument dropped (or replaced): what a careless backend would do."""

    def attention(module, query, key_states, value, attention_mask, **kwargs):
        kwargs.pop(key, None)
        if replacement is not None:
            kwargs[key] = replacement
        return varlen_attention_forward(module, query, key_states, value, attention_mask, **kwargs)

    return attention


@pytest.mark.parametrize(
    ("name", "argument", "replacement"),
    [
        ("gemma2", "softcap", None),
        ("gpt-oss", "s_aux", None),
        ("mistral", "sliding_window", None),
        ("phi3", "sliding_window", None),
        ("granite", "scaling", None),
        ("gemma3-bidirectional", "is_causal", True),
    ],
)
def test_a_dropped_attention_argument_is_seen(name, argument, replacement, probe_seqs, pad_id, monkeypatch):
    """Each architecture's peculiarity matters in its tiny config: a backend that ignores it is refused
    by the load-time probe, and every cell of the matrix shows it far above the bound."""
    model = zoo_model(name, probe_seqs)
    with torch.no_grad():
        reference = alone_logps(model, probe_seqs)
    monkeypatch.setitem(
        ALL_ATTENTION_FUNCTIONS._global_mapping, VARLEN_NAME, _dropping(argument, replacement)
    )
    (row,), limit = run_matrix(model, probe_seqs, pad_id, ("varlen",))
    assert (
        row.refused is not None
        and "leaks between packed sequences or drops an attention argument" in row.refused
    )
    model.set_attn_implementation(VARLEN_NAME)
    model.padless_attention = "varlen"
    with torch.no_grad():
        for layout in LAYOUTS:
            assert max_delta(layout_logps(model, probe_seqs, layout, pad_id), reference.logps) > 1e3 * limit


@pytest.mark.parametrize("name", ["gemma2", "gpt-oss", "deepseek-v3", "mistral"])
def test_architecture_matrix_bf16(name, probe_seqs, pad_id):
    """bf16 on CPU: the same cells within the bf16 bound (eps 2^-7: about a nat at |logit| 30)."""
    model = zoo_model(name, probe_seqs, torch.bfloat16)
    with torch.no_grad():
        reference = alone_logps(model, probe_seqs)
    rows, limit = run_matrix(model, probe_seqs, pad_id, ("varlen", "eager"))
    assert limit == bound(torch.bfloat16, reference.magnitude)
    for row in rows:
        if (name, row.backend) not in REFUSALS:
            assert row.ran and all(c.ok for c in row.cells), row


def test_readme_support_table_is_generated(zoo_results):
    """README's table is `padless check --zoo --backends varlen,sdpa,eager --markdown`, pasted: regenerate
    it when the zoo or a result changes (measured numbers, rounding-sensitive, are not compared)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = "<!-- zoo table: padless check --zoo --backends varlen,sdpa,eager --markdown -->"
    end = "<!-- end zoo table -->"
    assert start in readme and end in readme
    pasted = readme.split(start)[1].split(end)[0].strip()
    generated = format_zoo(list(zoo_results.values()), markdown=True).strip()

    def without_numbers(table: str) -> list[str]:
        return [re.sub(r"\d+\.\d+(e[-+]\d+)?", "#", line) for line in table.splitlines()]

    assert without_numbers(pasted) == without_numbers(generated)


def test_hybrid_linear_attention_really_cannot_be_packed(probe_seqs):
    """Why qwen3-next is refused: packed through position ids (sdpa), its linear-attention layers carry
    state from one sequence into the next; given cu_seqlens, transformers' PyTorch path refuses them.
    If a transformers release fixes both, this test fails: revisit the refusal."""
    from padless.packing import Example, pack

    model = build_zoo_model("qwen3-next", "sdpa")
    batch = pack([Example(s) for s in probe_seqs])
    with torch.no_grad():
        alone = torch.cat(
            [model(input_ids=torch.tensor(s)[None], use_cache=False).logits[0] for s in probe_seqs]
        )
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0]
        assert (packed - alone).abs().max() > 1e-2
        with pytest.raises(ValueError, match="can't keep packed sequences apart"):
            model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=False,
                **batch.attention_kwargs(),
            )
