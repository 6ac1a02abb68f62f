"""The distillation head: a student's per-token divergence from a frozen teacher over the whole vocabulary,
in chunks, equal to TRL 1.16's ``generalized_jsd_loss`` on the same logits, and to the teacher and student
each run on every sequence alone.

Logits are scaled to |logit| about 30 (real models' size, where fp32 round-off is largest). A divergence
sums ``p (log p - log q)`` over the vocabulary, so a log-prob error ``delta`` moves it by at most about
``2 delta`` (through ``log p`` and ``log q``; ``p`` sums to 1), with ``delta = bound(fp32, M)`` for log-probs
of size ``M`` (:func:`padless.proof.probe.bound`); tolerances are ``4 bound``.
"""

from __future__ import annotations

import pytest
import torch
from trl.experimental.gkd.gkd_trainer import GKDTrainer

from padless.forward.distill import Distillation, chunk_rows
from padless.forward.engine import ModelEngine
from padless.forward.packing import IGNORE_INDEX, Example, pack
from padless.losses import generalized_jsd, top_k_kl
from padless.proof.load import load_model
from padless.proof.probe import bound
from padless.proof.zoo import scale_head

LOGIT = 30.0
TOL = 4 * bound(torch.float32, LOGIT)


def realistic(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Logits of real models' size: a few tokens near the top, the rest far below."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 8 + torch.rand(shape, generator=g).pow(8) * 20


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_generalized_jsd_equals_trls(beta, temperature):
    """The pure function against ``GKDTrainer.generalized_jsd_loss`` on identical logits ``[2, 9, 512]``
    with masked positions: the loss and its gradient with respect to the student's logits."""
    student, teacher = realistic((2, 9, 512), 0), realistic((2, 9, 512), 1)
    labels = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(2))
    labels[0, :3] = labels[1, -2:] = IGNORE_INDEX
    s1 = student.clone().requires_grad_(True)
    trl = GKDTrainer.generalized_jsd_loss(s1, teacher, labels, beta=beta, temperature=temperature)
    trl.backward()
    s2 = student.clone().requires_grad_(True)
    keep = labels != IGNORE_INDEX
    ours = generalized_jsd(s2[keep] / temperature, teacher[keep] / temperature, beta).mean()
    ours.backward()
    assert ours.item() == pytest.approx(trl.item(), rel=1e-5, abs=TOL)
    torch.testing.assert_close(s2.grad, s1.grad, rtol=1e-4, atol=1e-7)
    planted = generalized_jsd(s2[keep] / temperature, teacher[keep] / temperature, 1 - beta).mean()
    assert beta == 0.5 or abs(planted.item() - trl.item()) > 1e-2  # the two directions differ


def test_top_k_kl_is_the_forward_kl_to_the_renormalised_top_k():
    student, teacher = realistic((5, 64), 3), realistic((5, 64), 4)
    assert torch.allclose(top_k_kl(student, teacher, 64), generalized_jsd(student, teacher, 0.0), atol=1e-5)
    top, ids = teacher.topk(4, -1)
    q = top.softmax(-1)
    want = (q * (q.log() - student.log_softmax(-1).gather(-1, ids))).sum(-1)
    torch.testing.assert_close(top_k_kl(student, teacher, 4), want, rtol=1e-5, atol=1e-6)


def models() -> tuple[ModelEngine, ModelEngine, float]:
    """A tiny Llama student (untied head) and a tiny Qwen2 teacher (tied, another architecture, the same
    tokenizer), both scaled to |logit| about 30; returns them and the largest |log-prob| seen."""
    student = load_model("tiny-llama", training=True)
    teacher = load_model("tiny-qwen2", seed=3)
    ids = torch.arange(5, 105)[None]
    with torch.no_grad():
        for m in (student, teacher):
            scale_head(m, LOGIT / m(input_ids=ids).logits.abs().max().item())
    return ModelEngine(student), ModelEngine(teacher).requires_grad_(False), LOGIT


def alone(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    """Logits of every position of ``seq`` from the model's own forward, alone (fp32)."""
    return model.model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()


@pytest.fixture(scope="module")
def seqs(probe_seqs):
    return [Example(s, [False] * 2 + [True] * (len(s) - 2)) for s in probe_seqs]


def test_chunked_head_equals_each_sequence_alone_and_trl(seqs):
    """The student's per-token divergence on a packed row of three sequences, in chunks of 32 rows (a 1 MB
    budget: 4 chunks of the 106 targets) and whole, equals TRL's loss on each sequence's own logits alone,
    with the teacher's logits made from its packed hidden states equal to its own forward alone; the
    gradients of the chunked and whole heads are equal, and the teacher's head ran once per chunk (and
    again per chunk in backward). ``beta`` 0.5 here: the pure function's test covers 0 and 1."""
    beta = 0.5
    student, teacher, _ = models()
    batch = pack(seqs)
    with torch.no_grad():
        t_hidden = teacher(batch, hidden=True).hidden
    targets = batch.loss_mask[0].float()
    calls = []
    teacher.register_forward_hook(
        lambda m, a, kw, out: calls.append(kw.get("head_of") is not None), with_kwargs=True
    )
    d = Distillation(
        t_hidden, teacher, lambda s, t: generalized_jsd(s, t, beta), targets / targets.sum(), temperature=2.0
    )
    got = {}
    for mb in (1, 1024):
        student.settings = type(student.settings)(logits_memory_mb=mb)
        student.zero_grad(set_to_none=True)
        calls.clear()
        out = student(batch, distill=d)
        out.weighted.backward()
        got[mb] = out, [p.grad.clone() for p in student.parameters()]
        n_chunks = -(-int(targets.sum()) // chunk_rows(4096, mb))
        assert sum(calls) == (2 * n_chunks if n_chunks > 1 else 1), (mb, calls)
    (chunked, g1), (whole, g2) = got[1], got[1024]
    torch.testing.assert_close(chunked.divergence, whole.divergence, rtol=0, atol=TOL)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * b.abs().max().item())

    # each sequence alone: the teacher's own logits, TRL's loss on them
    start = 0
    with torch.no_grad():
        packed_teacher = teacher(head_of=t_hidden)
    for e in seqs:
        n = len(e)
        s_logits, t_logits = alone(student, e.input_ids)[:-1], alone(teacher, e.input_ids)[:-1]
        torch.testing.assert_close(packed_teacher[start : start + n - 1], t_logits, rtol=0, atol=TOL)
        labels = torch.tensor(e.input_ids[1:])
        labels[:1] = IGNORE_INDEX  # the first target is position 1 (loss mask from the third token)
        trl = GKDTrainer.generalized_jsd_loss(
            s_logits[None], t_logits[None], labels[None], beta=beta, temperature=2.0, reduction="sum"
        )
        mine = chunked.divergence[start : start + n - 1].sum()
        assert mine.item() == pytest.approx(trl.item(), abs=TOL * n)
        start += n
