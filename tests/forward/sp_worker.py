"""One process of the sequence-parallel equality checks (launched N-fold by ``test_sequence_parallel.py``).

Each process computes the reference itself (the engine without sequence parallelism, on the whole row)
and the split run (the same weights through a sequence-parallel engine), and the first process writes
what it measured to ``OUT.json``: per-token log-prob, entropy and value differences, SFT / DPO / GRPO loss
differences, and the largest gradient difference (split gradients summed over the group, as the loop's
DDP / FSDP2 reduction sums them); then the same with rank 1's chunk planted one token early (the
off-by-one at the split that the equality check must catch).

Usage: ``torchrun --nproc_per_node N sp_worker.py OUT.json DEGREE``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from accelerate import PartialState

from padless.forward import ranks, sequence_parallel
from padless.forward.engine import EngineSettings, ModelEngine
from padless.forward.packing import Example, pack
from padless.losses import clipped_policy_loss, dpo_loss, group_advantages, kl_k3, sft_token_weights
from padless.proof.load import load_model

# straddling: with N=2 the split falls inside the second sequence (row 137 -> 138, chunks of 69), with
# N=4 inside the first and the second; the odd total makes the end padding real
LENGTHS = (41, 55, 23, 18)


def _batch() -> tuple[list[Example], torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    examples = []
    for n in LENGTHS:
        ids = torch.randint(3, 4096, (n,), generator=gen).tolist()
        examples.append(Example(ids, [i >= n // 3 for i in range(n)]))  # a prompt, then targets
    return examples, torch.rand(len(LENGTHS), generator=gen)


def _measure(
    engine: ModelEngine,
    model: torch.nn.Module,
    sp: sequence_parallel.SequenceParallel | None,
    anchor: torch.Tensor | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-token results, losses and their gradients; ``anchor``: the reference run's log-probs, from
    which DPO's reference and GRPO's old / reference log-probs are made (the same in both runs)."""
    examples, rewards = _batch()
    batch = pack(examples)
    mask = batch.loss_mask[0]
    normaliser = float(mask.sum())
    results: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}

    def grad_of(name: str, loss: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        if sp is not None:  # each rank holds its chunk's share; the data-parallel reduction sums them
            dist.all_reduce(flat, group=sp.group)
        grads[name] = flat
        results[f"{name}_loss"] = loss.detach()

    out = engine(batch, logps=True, entropy=True)
    results["logps"], results["entropy"] = out.logps.detach(), out.entropy.detach()
    anchor = results["logps"] if anchor is None else anchor
    noise = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(2)) * 0.1
    # SFT through the fused weighted head, as the SFT recipe runs it
    weighted = engine(batch, logps=True, logp_weights=sft_token_weights(mask, normaliser)).weighted
    grad_of("sft", weighted)
    # DPO: sequences (0, 1) and (2, 3) as chosen / rejected pairs, a fixed reference
    sums = batch.sequence_sums(engine(batch, logps=True).logps)
    ref = batch.sequence_sums(anchor + noise)
    losses, _, _ = dpo_loss(
        sums[0::2], sums[1::2], ref[0::2], ref[1::2], torch.ones(2), torch.ones(2), beta=0.1
    )
    grad_of("dpo", losses.sum())
    # GRPO: clipped surrogate with group advantages and a KL term, normalised by target tokens
    logps = engine(batch, logps=True).logps
    advantages = group_advantages(rewards.double(), 2).float()[batch.sequence_index]
    surrogate, _ = clipped_policy_loss(logps, anchor + noise, advantages, 0.2, 0.2)
    per_token = surrogate + 0.04 * kl_k3(logps, anchor - noise)
    grad_of("grpo", (per_token * mask).sum() / normaliser)
    return results, grads


def main(path: str, degree: int) -> None:
    state = PartialState(cpu=True)
    torch.manual_seed(0)
    model = load_model("tiny-llama", training=True, probe=False)
    # a value head for the values pass: a score model that shares nothing with the policy
    scorer = load_model("tiny-llama", task="score", training=False, probe=False)
    reference_engine = ModelEngine(model)
    ref, ref_grads = _measure(reference_engine, model, None, None)
    ref_values = ModelEngine(scorer)(pack(_batch()[0]), values=True).values
    topology = ranks.start(degree)
    sp = topology.sequence_parallel

    def compare() -> dict[str, float]:
        split = EngineSettings(topology=topology)  # the engine owns the group its rows are split over
        got, got_grads = _measure(ModelEngine(model, settings=split), model, sp, ref["logps"])
        values = ModelEngine(scorer, settings=split)(pack(_batch()[0]), values=True).values
        return {
            **{f"{k}_delta": (got[k] - ref[k]).abs().max().item() for k in ref},
            **{f"{k}_grad_delta": (got_grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads},
            "values_delta": (values - ref_values).abs().max().item(),
        }

    report = {
        "degree": sp.degree,
        "tokens": sum(LENGTHS),
        **{f"{k}_grad_scale": ref_grads[k].abs().max().item() for k in ref_grads},
        **{f"{k}_scale": ref[k].abs().max().item() for k in ref},
        "values_scale": ref_values.abs().max().item(),
        "exact": compare(),
    }
    # activations recomputed in backward (gradient checkpointing) run their attention split again
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    report["checkpointed"] = compare()
    model.gradient_checkpointing_disable()
    real = sequence_parallel.chunk_bounds

    def off_by_one(tokens: int, degree: int, rank: int) -> tuple[int, int]:  # rank 1 starts a token early
        start, end = real(tokens, degree, rank)
        return (start - 1, end - 1) if rank == 1 else (start, end)

    sequence_parallel.chunk_bounds = off_by_one
    report["planted"] = compare()
    sequence_parallel.chunk_bounds = real
    if state.is_main_process:
        with open(path, "w") as f:
            json.dump(report, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
