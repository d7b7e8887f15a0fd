import math

import pytest
import torch
from loss_helpers import loss_and_grad

from dflash.step.objective import block_labels, dflash_loss, expected_streak, position_weights, sample_anchors


def test_anchor_sampling_respects_loss_mask_and_lengths():
    g = torch.Generator().manual_seed(0)
    L = 40
    loss = torch.zeros(3, L, dtype=torch.bool)
    loss[0, 10:30] = True
    loss[1, :] = True
    seq = torch.tensor([30, 20, 0])
    a = sample_anchors(loss, seq, 8, g)
    assert a.shape == (3, 8)
    for b in range(3):
        valid = a[b][a[b] >= 0]
        assert torch.all(valid[1:] > valid[:-1]), "anchors sorted and distinct"
        assert torch.all(valid + 1 < seq[b]), "the first predicted token is inside the sequence"
        assert torch.all(loss[b, valid]), "the anchor itself is a trained token (as at inference)"
        assert torch.all(loss[b, valid + 1]), "the first predicted token is a loss token"
    assert (a[0] >= 10).all() and (a[0] <= 28).all()
    assert (a[2] == -1).all(), "an empty row gets no anchors"
    few = sample_anchors(loss[:1, :12], torch.tensor([12]), 8, g)
    assert few[0, :2].tolist() == [10, -1]  # 10 and its next token 11 are trained; 11 has no next


def test_labels_and_validity():
    ids = torch.arange(20).unsqueeze(0)
    loss = torch.ones(1, 20, dtype=torch.bool)
    loss[0, 12] = False
    labels, valid = block_labels(ids, loss, torch.tensor([15]), torch.tensor([[9, -1]]), 4)
    assert labels[0, 0].tolist() == [9, 10, 11, 12]
    assert valid[0, 0].tolist() == [False, True, True, False]  # k=0 never trained; 12 is not a loss token
    assert not valid[0, 1].any()
    _, v2 = block_labels(ids, loss, torch.tensor([11]), torch.tensor([[9, -1]]), 4)
    assert v2[0, 0].tolist() == [False, True, False, False]  # past the sequence end


def test_weights_and_streak():
    w = position_weights(4, 7.0)
    assert w[0] == 0 and w[1] == 1 and math.isclose(float(w[3]), math.exp(-2 / 7), rel_tol=1e-6)
    assert expected_streak([1.0, 1.0, 1.0]) == 3.0
    assert math.isclose(expected_streak([0.5, 0.5]), 0.5 + 0.25)
    assert expected_streak([0.9, float("nan"), 1.0]) == 0.9


def test_loss_matches_dense_reference_and_chunking():
    torch.manual_seed(0)
    B, A, K, H, V = 2, 3, 5, 8, 11
    hidden = torch.randn(B, A, K, H, requires_grad=True)
    head = torch.randn(V, H)
    labels = torch.randint(0, V, (B, A, K))
    valid = torch.rand(B, A, K) > 0.3
    valid[..., 0] = False
    out = dflash_loss(hidden, head, labels, valid, gamma=7.0, chunk_tokens=4)
    out.loss.backward()
    g_chunked = hidden.grad.clone()
    hidden.grad = None
    logits = hidden @ head.t()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none")
    w = position_weights(K, 7.0).expand(B, A, K).reshape(-1) * valid.reshape(-1)
    ref = (ce * w).sum() / w.sum()
    ref.backward()
    assert torch.allclose(out.loss, ref, atol=1e-5)
    assert torch.allclose(g_chunked, hidden.grad, atol=1e-6)
    correct = (logits.argmax(-1) == labels) & valid
    assert out.tokens == int(valid.sum())
    assert math.isclose(out.acc, float(correct.sum() / valid.sum()), rel_tol=1e-6)
    k1 = float(correct[..., 1].sum() / valid[..., 1].sum())
    assert math.isclose(out.acc_per_pos[0], k1, rel_tol=1e-6)


def _reference_loss(hidden, head, labels, valid, gamma):  # noqa: ANN001, ANN202
    V = head.shape[0]
    logits = (hidden @ head.t()).to(torch.promote_types(hidden.dtype, torch.float32))
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none")
    w = (
        position_weights(hidden.shape[2], gamma, hidden.device)
        .to(logits.dtype)
        .expand(valid.shape)
        .reshape(-1)
    )
    w = w * valid.reshape(-1)
    return (ce * w).sum() / w.sum()


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_gradient_taken_in_forward_matches_autograd_for_hidden_and_a_trainable_head(fused: bool):
    """The CE gradient is computed chunk by chunk during forward; it must equal plain autograd through
    the full logits, for the hidden states and (when it requires grad) the head, at any chunk size,
    eagerly and through the compiled chunk function (train.fused_loss), in float64."""
    torch.manual_seed(1)
    B, A, K, H, V = 2, 4, 6, 16, 37
    labels = torch.randint(0, V, (B, A, K))
    valid = torch.rand(B, A, K) > 0.25
    valid[..., 0] = False
    h0 = torch.randn(B, A, K, H, dtype=torch.float64)
    w0 = torch.randn(V, H, dtype=torch.float64)
    hidden_ref, head_ref = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = _reference_loss(hidden_ref, head_ref, labels, valid, 5.0)
    (ref * 3.0).backward()  # a non-unit upstream gradient must scale both
    for chunk in (1, 7, 10_000):
        hidden, head = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = dflash_loss(hidden, head, labels, valid, gamma=5.0, chunk_tokens=chunk, fused=fused)
        (out.loss * 3.0).backward()
        assert torch.allclose(out.loss, ref, atol=1e-10), chunk
        assert torch.allclose(hidden.grad, hidden_ref.grad, atol=1e-8), chunk
        assert torch.allclose(head.grad, head_ref.grad, atol=1e-6), chunk
        assert hidden.grad[~valid].abs().max() == 0, "untrained positions get no gradient"


def test_loss_under_bf16_autocast_and_with_nothing_to_train():
    torch.manual_seed(2)
    B, A, K, H, V = 1, 3, 4, 32, 50
    labels = torch.randint(0, V, (B, A, K))
    valid = torch.ones(B, A, K, dtype=torch.bool)
    valid[..., 0] = False
    hidden = torch.randn(B, A, K, H, requires_grad=True)
    head = torch.randn(V, H) * 0.2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dflash_loss(hidden, head, labels, valid, gamma=7.0, chunk_tokens=5)
    out.loss.backward()
    ref_hidden = hidden.detach().clone().requires_grad_()
    ref = _reference_loss(ref_hidden, head, labels, valid, 7.0)
    ref.backward()
    assert torch.allclose(out.loss, ref, rtol=2e-2)
    assert torch.allclose(hidden.grad, ref_hidden.grad, atol=2e-3, rtol=5e-2)
    assert hidden.grad.dtype == torch.float32

    none = dflash_loss(hidden, head, labels, torch.zeros_like(valid), gamma=7.0)
    none.loss.backward()
    assert none.tokens == 0 and none.loss.item() == 0 and math.isnan(none.acc)


def test_fused_loss_is_one_graph_for_every_batch_and_matches_the_eager_chunk():
    """The trained-token count changes with every batch: the compiled chunk keeps one graph (its row
    count dynamic, padded rows weighted 0), and loss, accuracy and gradient equal the eager path's."""
    from torch._dynamo.utils import counters

    torch.manual_seed(3)
    B, A, K, H, V = 2, 20, 8, 16, 97
    labels = torch.randint(0, V, (B, A, K))
    head = torch.randn(V, H, dtype=torch.float64)
    h0 = torch.randn(B, A, K, H, dtype=torch.float64)
    dflash_loss(h0.clone().requires_grad_(), head, labels, torch.rand(B, A, K) > 0.5, 7.0, 64, fused=True)
    graphs = counters["stats"]["unique_graphs"]
    for thr in (0.1, 0.45, 0.8, 0.97):
        valid = torch.rand(B, A, K) > thr
        valid[..., 0] = False
        (eager, g_eager), (fused_out, g_fused) = (
            loss_and_grad(h0, head, labels, valid, chunk_tokens=100, fused=fused) for fused in (False, True)
        )
        assert fused_out.tokens == eager.tokens == int(valid.sum())
        assert torch.allclose(fused_out.loss, eager.loss, atol=1e-12)
        assert torch.allclose(g_fused, g_eager, atol=1e-14)
        assert fused_out.acc_per_pos == eager.acc_per_pos
    assert counters["stats"]["unique_graphs"] == graphs, "a new trained-token count recompiled the loss"


@pytest.mark.gpu
def test_fused_loss_on_gpu_matches_the_float64_reference_within_bf16_tolerance():
    """Under bf16 autocast on the GPU, as the trainer runs it: loss and input gradient against the
    float64 reference; the chunked path never holds the [N, V] logits (peak well under one copy)."""
    torch.manual_seed(4)
    dev = torch.device("cuda")
    # Chunks of 256 of about 7,000 trained tokens: a chunk's few fp32 [256, V] temporaries stay far
    # under one bf16 copy of the [N, V] logits (with 1,024-token chunks the eager path's 4-5
    # temporaries of a third of N already exceeded it, and the bound told nothing).
    B, A, K, H, V = 2, 256, 16, 512, 32000
    labels = torch.randint(0, V, (B, A, K), device=dev)
    valid = torch.rand(B, A, K, device=dev) > 0.1
    valid[..., 0] = False
    h0 = torch.randn(B, A, K, H, device=dev)
    head = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.05
    ref_hidden = h0.double().requires_grad_()
    ref = _reference_loss(ref_hidden, head.double(), labels, valid, 7.0)
    ref.backward()
    n = int(valid.sum())
    for fused in (False, True):
        hidden = h0.clone().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = dflash_loss(hidden, head, labels, valid, gamma=7.0, chunk_tokens=256, fused=fused)
        out.loss.backward()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak < n * V * 2, f"fused={fused}: {peak / 2**20:.0f} MiB is a full copy of the logits"
        assert abs(out.loss.item() - ref.item()) < 2e-2 * ref.item(), fused
        err = (hidden.grad.double() - ref_hidden.grad).norm() / ref_hidden.grad.norm()
        assert err < 2e-2, f"fused={fused}: relative gradient error {err:.2e}"


def test_trained_count_started_early_gives_the_same_loss_and_metrics():
    """The trainer counts the trained positions before the forward (trained_count) and hands the count
    to the loss, which then never reads the device mid-step; without it the loss counts itself."""
    from dflash.step.objective import trained_count

    torch.manual_seed(5)
    B, A, K, H, V = 2, 6, 5, 8, 13
    labels = torch.randint(0, V, (B, A, K))
    valid = torch.rand(B, A, K) > 0.4
    valid[..., 0] = False
    head = torch.randn(V, H, dtype=torch.float64)
    h0 = torch.randn(B, A, K, H, dtype=torch.float64)
    early = trained_count(valid)
    assert early.get() == int(valid.sum())
    outs = []
    for trained in (early, None):
        hidden = h0.clone().requires_grad_()
        out = dflash_loss(hidden, head, labels, valid, 7.0, 4, trained=trained)
        out.loss.backward()
        outs.append((out, hidden.grad))
    (a, ga), (b, gb) = outs
    assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb)
    assert a.tokens == b.tokens == int(valid.sum()) and a.acc_per_pos == b.acc_per_pos


def test_metrics_started_for_the_host_read_the_same_in_any_order():
    """The trainer starts a step's metrics for the host when it queues the step (start_read) and
    reads them later (read_started): the values are those of a read at the time of use, whether a
    metric is read first or read_started is called more than once."""
    torch.manual_seed(6)
    B, A, K, H, V = 2, 4, 5, 8, 13
    labels = torch.randint(0, V, (B, A, K))
    valid = torch.rand(B, A, K) > 0.4
    valid[..., 0] = False
    head, hidden = torch.randn(V, H), torch.randn(B, A, K, H)
    extra = (torch.tensor(2.5), torch.tensor(7))

    def loss():
        return dflash_loss(hidden, head, labels, valid, 7.0, 4)

    now = loss()
    want = now.read_with(*extra)
    assert want == [2.5, 7.0]
    metric_first = loss()
    metric_first.start_read(*extra)
    assert metric_first.acc_per_pos == now.acc_per_pos and metric_first.tokens == int(valid.sum())
    assert metric_first.read_started() == want and metric_first.read_started() == want
    read_first = loss()
    read_first.start_read(*extra)
    assert read_first.read_started() == want and read_first.acc == now.acc and read_first.streak == now.streak
    with pytest.raises(AssertionError, match="start_read first"):
        loss().read_started()
