"""The architecture matrix: every zoo architecture, alone / left / right / packed, on every CPU backend
that accepts it, per token against each sequence alone on eager, within the scaled bound; or refused
with its reason. Logits are scaled to |logit| 30, where real models live and round-off is largest.

(flex_attention compiles one kernel per shape on CPU, minutes for the zoo: it runs in test_check.py on
the embedded models and in ``padless check --zoo --backends flex_attention``.)
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from padless.forward.attention import VARLEN_NAME
from padless.forward.varlen import varlen_attention_forward
from padless.proof.check import (
    LAYOUTS,
    VERDICTS,
    ZooResult,
    alone_logps,
    format_zoo,
    layout_logps,
    max_delta,
    probe_sequences,
    run_matrix,
    run_zoo,
    zoo_failures,
    zoo_model,
)
from padless.proof.probe import bound, prove_packing
from padless.proof.zoo import (
    LOGIT_TARGET,
    ZOO,
    build_zoo_model,
    causal_lm_types,
    image_text_types,
    zoo_config,
    zoo_names,
)

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
    # Llama 4's NoPE layers scale queries by their place in the row: only varlen moves it into the sequence
    **{("llama4_text", b): "NoPE layers by each token's place in the whole row" for b in ("sdpa", "eager")},
}
CAPPED = {"gemma2"}  # a final logit soft-cap of 30 keeps |logit| below 30
# Derived from transformers' own config classes, beside the hand-built ones in CI: a logits scale (Cohere's
# logit_scale), learned absolute positions (GPT-2), a state-space layer in every block (Mamba), Mamba-2
# beside attention (Falcon-H1), Qwen3.5's gated delta-nets, an image-text-to-text model on its text
# (Qwen2.5-VL: M-RoPE sections cut to the tiny head), lightning attention beside full attention (MiniMax,
# blocks of 8) and indexed sparse attention (DeepSeek-V3.2, top-8 keys per query). The whole list runs
# behind `zoo_full`.
CI_DERIVED = (
    "cohere",
    "gpt2",
    "mamba",
    "falcon_h1",
    "qwen3_5_text",
    "qwen2_5_vl",
    "minimax",
    "deepseek_v32",
)
CI_ZOO = (*ZOO, *CI_DERIVED)


def test_zoo_adds_the_image_text_models_padless_loads():
    """Vision-language configs (a vision tower: padless loads them) join the causal-LM types, once each."""
    from transformers import CONFIG_MAPPING

    names, vlms = zoo_names(), image_text_types()
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"} <= set(vlms) <= set(names)
    assert len(names) == len(set(names)) and not set(vlms) & set(causal_lm_types())
    assert all(zoo_config(t).vision_config is not None for t in ("qwen2_5_vl", "llava"))
    assert all("vision_config" in CONFIG_MAPPING[t].sub_configs for t in vlms)


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


def test_zoo_lists_every_causal_lm_architecture_of_transformers():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert causal_lm_types() == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert zoo_names()[: len(ZOO)] == list(ZOO) and set(causal_lm_types()) <= set(zoo_names())
    assert len(zoo_names()) == len(set(zoo_names()))
    assert set(CI_DERIVED) <= set(causal_lm_types()) | set(image_text_types())


@pytest.mark.parametrize("name", CI_DERIVED)
def test_derived_configs_are_tiny_and_keep_what_matters(name):
    config = zoo_config(name).get_text_config()
    assert getattr(config, "hidden_size", 64) == 64 and config.vocab_size == 4096
    if name == "falcon_h1":
        assert config.num_hidden_layers == 2


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
    llama4 = zoo_config("llama4_text")  # chunks and the temperature floor far shorter than the probe's rows
    assert llama4.layer_types == ["chunked_attention", "full_attention"] and llama4.no_rope_layers == [1, 0]
    assert llama4.attention_chunk_size == 8 and llama4.floor_scale == 32 and llama4.attn_temperature_tuning


@pytest.fixture(scope="module")
def zoo_seqs(tokenizer) -> list[list[int]]:
    """The sequences `padless check --zoo` runs (lengths 4 to 160), so the docs' zoo table can be compared."""
    return probe_sequences(tokenizer)


@pytest.fixture(scope="module")
def zoo_results(zoo_seqs, pad_id) -> dict[str, ZooResult]:
    """The matrix of CI's architectures, computed once for the module."""
    return {z.name: z for z in run_zoo(zoo_seqs, pad_id, BACKENDS, CI_ZOO)}


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


@pytest.mark.parametrize(
    "name",
    [
        "gemma2",
        "gpt-oss",
        "deepseek-v3",
        "mistral",
    ],
)
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


def _docs_table() -> str:
    page = (Path(__file__).resolve().parents[2] / "docs" / "zoo.md").read_text()
    start = "<!-- zoo table: padless check --zoo --backends varlen --markdown -->"
    end = "<!-- end zoo table -->"
    assert start in page and end in page
    return page.split(start)[1].split(end)[0].strip()


def _on_varlen(result: ZooResult) -> ZooResult:
    """The result as `--backends varlen` reports it (the docs' table: the backend padless trains on)."""
    return dataclasses.replace(result, rows=[r for r in result.rows if r.backend == "varlen"])


def _without_numbers(table: str) -> list[str]:
    """Measured numbers are rounding-sensitive; reason numbers depend on which rows were generated."""
    return [re.sub(r"\d+\.\d+(e[-+]\d+)?|\[\d+\]", "#", line) for line in table.splitlines()]


def test_docs_support_table_is_generated(zoo_results):
    """docs/zoo.md's table is `padless check --zoo --backends varlen --markdown`, pasted: it lists
    every architecture of the zoo with the count per verdict, and CI's rows are what CI computes now
    (regenerate it when the zoo, transformers or a result changes; `zoo_full` compares every row)."""
    pasted = _docs_table()
    rows = {
        line.split(" | ")[0].removeprefix("| "): line for line in pasted.splitlines() if line.startswith("| ")
    }
    assert [n for n in rows if n != "architecture"] == zoo_names()
    count = re.search(r"^(\d+) architectures: (.*)$", pasted, re.M)
    assert count and int(count[1]) == len(zoo_names())
    generated = format_zoo([_on_varlen(z) for z in zoo_results.values()], markdown=True)
    for line in generated.splitlines():
        if line.startswith("| ") and not line.startswith("| architecture"):
            name = line.split(" | ")[0].removeprefix("| ")
            assert _without_numbers(rows[name]) == _without_numbers(line), name


def _varlen_cells(model, seqs, pad_id) -> dict[str, float]:
    """What `padless check` would measure on varlen if the probe let it run: per layout, the largest
    per-token |delta log-prob| against each sequence alone on eager (no entry where the layout stops)."""
    with torch.no_grad():
        model.set_attn_implementation("eager")
        reference = alone_logps(model, seqs).logps
        model.set_attn_implementation(VARLEN_NAME)
        model.padless_attention = "varlen"
        cells = {}
        for layout in LAYOUTS:
            try:
                cells[layout] = max_delta(layout_logps(model, seqs, layout, pad_id), reference)
            except Exception:  # a layout that stops with an error is loud, not silently wrong
                continue
    return cells


def _check_fails_implies_training_refuses(name, seqs, pad_id) -> None:
    try:
        model = zoo_model(name, seqs)
    except Exception:  # no tiny config: nothing is trained, nothing to prove
        return
    with torch.no_grad():
        limit = bound(torch.float32, alone_logps(model, seqs).magnitude)
    cells = _varlen_cells(model, seqs, pad_id)
    model.set_attn_implementation(VARLEN_NAME)
    try:
        prove_packing(model, "varlen")  # what load_model runs before training
    except Exception as e:
        refused: str | None = str(e)
    else:
        refused = None
    failing = {layout: d for layout, d in cells.items() if not d <= limit}
    assert not failing or refused, f"{name}: check fails on varlen ({failing}, bound {limit:.3g}) yet loads"


@pytest.mark.parametrize("name", CI_ZOO)
def test_check_fails_implies_training_refuses(name, zoo_seqs, pad_id):
    """Over the zoo: wherever `padless check` on varlen would be over its bound, the load-time probe
    (what training runs first) refuses the model; and no architecture ends FAILED."""
    _check_fails_implies_training_refuses(name, zoo_seqs, pad_id)


def test_every_ci_architecture_has_a_verdict(zoo_results):
    # no cell over its bound on any backend, derived configs included (Qwen2.5-VL's sdpa / eager packed
    # cells leaked 23.8 nats while its probe passed, until packed rows got M-RoPE rows in the engine)
    assert zoo_failures(list(zoo_results.values())) == []
    for z in zoo_results.values():
        assert z.verdict in VERDICTS[:3], (z.name, z.verdict, z.reason)
        assert (z.verdict == "exact") == (z.reason is None), z.name
    # Cohere's logits * logit_scale, reproduced by the head (a transform it has no name for is refused:
    # tests/proof/test_probe.py); DeepSeek-V3.2's indexer chooses keys within each sequence
    assert zoo_results["cohere"].verdict == zoo_results["deepseek_v32"].verdict == "exact"
    # hybrids: gated delta-nets, a short convolution, Mamba-2 beside attention; and pure Mamba, whose
    # blocks are handed no sequence boundaries (its decoder's call gives them)
    for hybrid in ("qwen3-next", "lfm2", "qwen3_5_text", "falcon_h1", "mamba", "minimax"):
        assert zoo_results[hybrid].verdict == "exact", zoo_results[hybrid].reason


# ----------------------------------------------------------------------------------------------------------
# Every causal-LM architecture of transformers (pytest -m zoo_full: minutes)
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_results(zoo_seqs, pad_id) -> list[ZooResult]:
    return run_zoo(zoo_seqs, pad_id, ("varlen",))


@pytest.mark.zoo_full
def test_full_zoo_has_a_verdict_for_every_architecture_and_matches_the_docs(full_results):
    assert [z.name for z in full_results] == zoo_names()
    assert all(z.verdict in VERDICTS[:3] for z in full_results), [
        (z.name, z.verdict) for z in full_results if z.verdict not in VERDICTS[:3]
    ]
    generated = format_zoo(full_results, markdown=True)
    assert _without_numbers(_docs_table()) == _without_numbers(generated.strip())


@pytest.mark.zoo_full
@pytest.mark.parametrize("name", [n for n in zoo_names() if n not in CI_ZOO])
def test_full_zoo_check_fails_implies_training_refuses(name, zoo_seqs, pad_id):
    _check_fails_implies_training_refuses(name, zoo_seqs, pad_id)
