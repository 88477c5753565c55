"""Expert parallel's dispatch on its own, against the one-process MoE block: two ranks each hold half of the
experts and half of the tokens; the all-to-alls must hand every assignment to its expert and back, with
gradients, whatever the routing: spread over every expert, or forced onto one expert (dropless: every token
is processed, and the rank whose experts get nothing still takes part in every all-to-all, forward and
backward)."""

import pytest
import torch

from tessera.launching.launch import run_ranks


def _block(top_k: int, force: int | None):
    from tessera.models.moe import MoE

    torch.manual_seed(0)
    block = MoE(dim=16, ffn_dim=8, n_experts=4, top_k=top_k, aux_loss_coef=0.0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    if force is not None:  # the bias steers every token to one expert
        block.expert_bias[force] = 100.0
    return block


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, 16, generator=g), torch.randn(4, 6, 16, generator=g)


def one_process(top_k: int, force: int | None):
    block = _block(top_k, force)
    x, probe = _data()
    x.requires_grad_(True)
    out = block(x)
    (out * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return out.detach(), x.grad, grads, block.tokens_per_expert.clone()


def on_two_ep_ranks(top_k: int, force: int | None):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tessera.parallel.expert import apply_ep
    from tessera.topology import Layout, Meshes

    meshes = Meshes(Layout(dp_shard=2, ep=2), "cpu")
    rank = dist.get_rank()
    block = apply_ep(_block(top_k, force), meshes.ep, None)
    x, probe = _data()
    mine = slice(2 * rank, 2 * rank + 2)  # each rank its half of the rows
    x = x[mine].clone().requires_grad_(True)
    out = block(x)
    (out * probe[mine]).sum().backward()
    grads = {}
    for n, p in block.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):  # this rank's experts: gather the whole stack
            g = g.full_tensor()
        else:  # a replicated parameter (the router): sum the ranks' parts
            dist.all_reduce(g)
        grads[n] = g
    counts = block.tokens_per_expert.clone()
    dist.all_reduce(counts)
    return rank, out.detach(), x.grad, grads, counts, block.experts.dispatch.received


@pytest.mark.parametrize(
    "top_k,force", [(2, None), (1, 0), (1, 3)], ids=["spread", "all-to-expert-0", "all-to-expert-3"]
)
def test_two_ep_ranks_compute_what_one_process_does(top_k, force):
    out, x_grad, grads, counts = one_process(top_k, force)
    ranks = run_ranks(on_two_ep_ranks, 2, top_k, force, timeout=120)
    for rank, r_out, r_x_grad, r_grads, r_counts, _ in ranks:
        rows = slice(2 * rank, 2 * rank + 2)
        torch.testing.assert_close(r_out, out[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r_x_grad, x_grad[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r_counts, counts, rtol=0, atol=0)
        for name, g in grads.items():
            # expert gradients are scaled by 1/ep (FSDP2's mean over the ranks holding them then makes the
            # mean over all data ranks); the router's parts were summed above
            scale = 2.0 if name.startswith("experts.") else 1.0
            torch.testing.assert_close(r_grads[name] * scale, g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    if force is not None:  # dropless: every token at its one expert, on the rank that holds it
        assert counts.tolist() == [24.0 if e == force else 0.0 for e in range(4)]
        holder = force // 2
        assert [r[5] for r in sorted(ranks, key=lambda r: r[0])] == [24 if holder == 0 else 0, 24 if holder == 1 else 0]
