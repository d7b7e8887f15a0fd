"""The drafter step's optimizer end: clipping folded into the fused optimizer, and a step that never
waits for the device before its optimizer update (checked for real on the GPU)."""

from __future__ import annotations

import copy
import math
import traceback
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash.step.trainer import clip_and_step


def _params_with_grads(scale: float, seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((7, 5), (5,), (3, 4, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    return params


@pytest.mark.parametrize("scale", [100.0, 1e-3], ids=["clipped", "under-the-limit"])
def test_clip_folded_into_the_fused_optimizer_equals_clip_then_step(scale: float):
    """AdamW(fused=True) divides the gradients by grad_scale in its kernel; three steps through
    clip_and_step must land where clip_grad_norm_ + step lands, with the same reported norm."""
    ref, folded = _params_with_grads(scale), _params_with_grads(scale)
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    opt_folded = torch.optim.AdamW(folded, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        if step:
            for i, (a, b) in enumerate(zip(_params_with_grads(scale, seed=step), ref, strict=True)):
                b.grad = a.grad.clone()
                folded[i].grad = a.grad.clone()
        want = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        opt_ref.step()
        got = clip_and_step(opt_folded, folded, 1.0)
        assert torch.allclose(got, want, rtol=1e-6)
        assert hasattr(opt_folded, "grad_scale") and not hasattr(opt_ref, "grad_scale")
        for a, b in zip(folded, ref, strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    moved = sum(float((a - b).abs().max()) for a, b in zip(folded, _params_with_grads(scale), strict=True))
    assert moved > 1e-3, "the parameters did not move"


def test_unfused_optimizer_clips_the_gradients_themselves():
    params = _params_with_grads(100.0)
    opt = torch.optim.AdamW(params, lr=1e-2)
    norm = clip_and_step(opt, params, 1.0)
    assert float(norm) > 10.0
    clipped = torch.nn.utils.get_total_norm([p.grad for p in params])
    assert abs(float(clipped) - 1.0) < 1e-4
    assert not hasattr(opt, "grad_scale")


SIZES = dict(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    vocab_size=1024,
    max_position_embeddings=4096,
)


def _trainer(repo: Path, dev: torch.device, dtype: torch.dtype, *sets: str):
    """A DrafterTrainer of the shipped 8B config's structure at a small size (one 512 bucket)."""
    from transformers import Qwen3Config

    from dflash.config import load_config
    from dflash.step.model import resolve_spec
    from dflash.step.trainer import DrafterTrainer

    cfg = load_config(
        repo / "configs" / "qwen3-8b.toml",
        [
            "data.max_seq_len=512",
            "data.bucket_multiple=512",
            "data.min_seq_len=32",
            "train.token_budget=1024",
            "train.max_batch_size=2",
            "train.num_anchors=64",
            "train.loss_chunk_tokens=1024",
            "drafter.num_target_layers=3",
            "drafter.sliding_window=128",
            f"drafter.mask_token_id={SIZES['vocab_size'] - 1}",
            *sets,
        ],
    )
    spec = resolve_spec(cfg.drafter, Qwen3Config(**SIZES), cfg.drafter.mask_token_id)
    gen = torch.Generator().manual_seed(0)
    embed = (torch.randn(spec.vocab_size, spec.hidden_size, generator=gen) * 0.02).to(dev, dtype)
    head = (torch.randn(spec.vocab_size, spec.hidden_size, generator=gen) * 0.02).to(dev, dtype)
    return DrafterTrainer(cfg, spec, embed, head, dev), spec


CPU_SETS = (  # a small CPU drafter: one 128-token bucket, uncompiled sdpa
    "run.device=cpu",
    "attention.backend=sdpa",
    "attention.compile=false",
    "target.dtype=float32",
    "data.max_seq_len=128",
    "data.bucket_multiple=128",
    "train.token_budget=256",
    "train.num_anchors=16",
    "drafter.sliding_window=32",
)


def _batches(spec, n: int, features_dtype: torch.dtype, B: int = 2, S: int = 512) -> list[tuple]:
    """n host batches of one shape, as pad_batch hands them to the trainer."""
    gen = torch.Generator().manual_seed(1)
    features = len(spec.target_layer_ids) * spec.target_hidden_size
    return [
        (
            torch.randint(0, spec.vocab_size - 1, (B, S), generator=gen),
            torch.ones(B, S, dtype=torch.bool),
            torch.full((B,), S),
            torch.randn(B, S, features, generator=gen).to(features_dtype),
        )
        for _ in range(n)
    ]


def test_step_ahead_reads_each_step_once_in_order_and_drains_checkpoint_steps(repo):
    """StepAhead (how the job's loops step: one step queued ahead of the one read back) gives the
    same results as plain train_step calls, in step order; a drain step (a checkpoint) comes back
    from the push that queued it with nothing queued after it, so the weights then are that step's;
    read_now reads at once yet returns with the next push, like any other step."""
    from dflash.step.trainer import StepAhead

    # One 128-token bucket: the order and drain semantics do not need the 512 one (a quarter the CPU).
    sets = CPU_SETS
    cpu = torch.device("cpu")
    batches = _batches(_trainer(repo, cpu, torch.float32, *sets)[1], 5, torch.float32, S=128)
    ref, _ = _trainer(repo, cpu, torch.float32, *sets)
    want = [ref.train_step(*b) for b in batches]
    trainer, _ = _trainer(repo, cpu, torch.float32, *sets)
    ahead = StepAhead(trainer, drain=lambda step: step == 3)
    got: list[list[tuple[int, str]]] = []
    results = []
    for i, b in enumerate(batches):
        done = ahead.push(*b, tag=f"batch-{i}", read_now=i == 0)
        got.append([(r.step, tag) for r, tag in done])
        results += [r for r, _ in done]
        if i == 2:  # step 3 drained: nothing queued after it, the weights are step 3's
            assert trainer.step == 3 and ahead.pending_result is None
            ref3, _ = _trainer(repo, cpu, torch.float32, *sets)
            for b3 in batches[:3]:
                ref3.train_step(*b3)
            for p, q in zip(trainer.params, ref3.params, strict=True):
                assert torch.equal(p, q)
    assert ahead.pending_result is None  # step 5 (not read_now) is still queued
    tail = ahead.flush()
    got.append([(r.step, tag) for r, tag in tail])
    results += [r for r, _ in tail]
    assert got == [
        [],
        [(1, "batch-0")],
        [(2, "batch-1"), (3, "batch-2")],
        [],
        [(4, "batch-3")],
        [(5, "batch-4")],
    ]
    assert ahead.flush() == []
    assert [r.loss for r in results] == [r.loss for r in want]
    assert [r.grad_norm for r in results] == [r.grad_norm for r in want]
    assert [r.acc_per_pos for r in results] == [r.acc_per_pos for r in want]


def test_bf16_weights_checkpoint_holds_the_float32_masters(repo, monkeypatch):
    """train.bf16_weights: every linear weight is bf16 and its float32 master starts at the float32
    run's initial value; the norms stay float32. A checkpoint's weights are the masters (exact
    resume), and they load back into a bf16-weights trainer (masters exact, weights rounded to
    nearest) and into a float32 one alike. No step is taken: off the GPU the masters' kernel runs
    only under Triton's interpreter, which resolve_bf16_weights accepts for this construction."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    trainer, _ = _trainer(repo, cpu, torch.float32, *CPU_SETS, "train.bf16_weights=true")
    plain, _ = _trainer(repo, cpu, torch.float32, *CPU_SETS, "train.bf16_weights=false")
    assert trainer.bf16_weights and not plain.bf16_weights and not plain.masters
    linears = {n for n, m in trainer.model.named_modules() if isinstance(m, nn.Linear)}
    named = dict(trainer.model.named_parameters())
    for name, p in named.items():
        want = torch.bfloat16 if name.removesuffix(".weight") in linears else torch.float32
        assert p.dtype == want, name
        assert (p in trainer.masters) == (want == torch.bfloat16), name
    assert len(trainer.masters) == len(linears) == 1 + 7 * trainer.spec.num_layers
    start = trainer.weights()
    for name, p in plain.model.named_parameters():
        assert start[name].dtype == torch.float32 and torch.equal(start[name], p.detach()), name
    with torch.no_grad():  # as training leaves them: masters off the bf16 grid
        for p, master in trainer.masters.items():
            master.add_(torch.randn(master.shape, generator=torch.Generator().manual_seed(3)) * 1e-4)
            p.copy_(master)
    saved = {k: v.clone() for k, v in trainer.weights().items()}
    assert all(torch.equal(saved[n], trainer.masters[p]) for n, p in named.items() if p in trainer.masters)
    again, _ = _trainer(repo, cpu, torch.float32, *CPU_SETS, "train.bf16_weights=true")
    again.load_state_dict(trainer.state_dict(), saved)
    for name, p in again.model.named_parameters():
        if p in again.masters:
            assert torch.equal(again.masters[p], saved[name]) and torch.equal(p, saved[name].to(p.dtype)), (
                name
            )
        else:
            assert torch.equal(p, saved[name]), name
    plain.load_state_dict(trainer.state_dict(), saved)
    assert all(torch.equal(p, saved[n]) for n, p in plain.model.named_parameters())


@pytest.mark.gpu
def test_bf16_weights_train_as_float32_weights_and_resume_exactly(repo):
    """On the GPU, the job's own step: bf16 weights with float32 masters against float32 weights
    under autocast, three steps of the same batches. The maths is the same, not the rounding order:
    without the weights' casts inductor fuses the layers' other kernels differently (H200, 2026-12-03:
    the first loss 6.96841 against 6.96846, the same matrix-product kernels), so losses, gradient
    norms and weights agree to bf16 tolerance, far inside what three steps move them. A resume from
    the checkpoint's weights (the masters) then continues bitwise."""
    dev = torch.device("cuda")
    ref, spec = _trainer(repo, dev, torch.bfloat16, "train.bf16_weights=false")
    mine, _ = _trainer(repo, dev, torch.bfloat16)  # auto: a single drafter on a GPU
    assert mine.bf16_weights and not ref.bf16_weights
    assert all(p.dtype == torch.bfloat16 for p in mine.masters)
    start = {k: v.clone() for k, v in ref.weights().items()}
    batches = _batches(spec, 5, torch.bfloat16)
    want = [ref.train_step(*b) for b in batches[:3]]
    got = [mine.train_step(*b) for b in batches[:3]]
    for a, b in zip(got, want, strict=True):
        assert math.isclose(a.loss, b.loss, rel_tol=1e-4), (a.loss, b.loss)
        assert math.isclose(a.grad_norm, b.grad_norm, rel_tol=1e-2), (a.grad_norm, b.grad_norm)
        assert a.acc_per_pos == pytest.approx(b.acc_per_pos, abs=0.01)
    theirs = ref.weights()
    for name, w in mine.weights().items():
        # Norms, not maxima: Adam's first steps move each weight by about lr * sign(gradient), and a
        # gradient near zero may take the other sign under the other rounding.
        moved = float((theirs[name] - start[name]).norm())
        apart = float((w - theirs[name]).norm())
        assert w.dtype == torch.float32 and moved > 0 and apart <= 0.2 * moved, (name, apart, moved)
    resumed, _ = _trainer(repo, dev, torch.bfloat16)
    # As a checkpoint hands them over: copies, not the live optimizer's tensors.
    resumed.load_state_dict(
        copy.deepcopy(mine.state_dict()), {k: v.clone() for k, v in mine.weights().items()}
    )
    for b in batches[3:]:
        x, y = mine.train_step(*b), resumed.train_step(*b)
        assert (x.loss, x.grad_norm) == (y.loss, y.grad_norm)
    for p, q in zip(mine.params, resumed.params, strict=True):
        assert torch.equal(p, q)
        if p in mine.masters:
            assert torch.equal(mine.masters[p], resumed.masters[q])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "sets",
    [
        ["attention.flex_kernels=dflash", "attention.fused_qk_norm_rope=false"],
        ["attention.flex_kernels=flex"],
        ["attention.flex_kernels=dflash"],  # the q/k kernel on: auto
    ],
    ids=["dflash-noqk", "flex", "dflash+qk"],
)
def test_the_drafter_step_never_waits_for_the_gpu_before_its_metrics_are_read(repo, sets):
    """The whole step (anchors, forward, block masks, the fused loss, backward, clipping, fused AdamW)
    is queued without one device sync: CUDA's sync debug mode reports each, with where it came from.
    The metrics are read once, afterwards, and match a plain train_step's kind of result."""
    dev = torch.device("cuda")
    trainer, spec = _trainer(repo, dev, torch.bfloat16, *sets)
    assert trainer.fused_loss and trainer.optimizer.defaults["fused"]
    B, S = 2, 512
    (batch,) = _batches(spec, 1, torch.bfloat16, B, S)  # on the host, as pad_batch hands them
    first = trainer.train_step(*batch)  # compiles
    torch.cuda.synchronize()
    # "warn", not "error": every synchronizing call is collected with the stack that made it, so one
    # GPU run names all of them (an error stops at the first).
    syncs: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if "synchronizing CUDA operation" in str(message):
            here = [f for f in traceback.extract_stack() if "/dflash/" in f.filename]
            syncs.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(here)))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            queued = trainer.queue_step(*batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not syncs, "the step waited for the device at:\n" + "\n".join(syncs)
    r = trainer.read_step(queued)
    assert r.step == 2 and r.tokens == B * S and 0 < r.block_tokens <= B * 64 * (spec.block_size - 1)
    assert r.loss < first.loss + 1.0 and r.grad_norm > 0 and 0 <= r.acc <= 1
    assert len(r.acc_per_pos) == spec.block_size - 1


@pytest.mark.gpu
def test_a_host_copy_is_written_by_a_kernel_and_never_waits_behind_a_long_copy():
    """HostCopy's values, an int64 count and float32 metrics, reach the host exactly, written by a
    kernel; and a read queued while a 2 GiB device-to-host copy runs on another stream (a state copy,
    dflash.pipeline.state_copy) comes back before that copy ends. Through the copy engine it waited
    for all of it, and the stream that queued it stalled as long (H100, 2026-12-07: 150 products
    230 ms with two reads, 373 ms beside an 8.6 GB copy; docs/benchmarks-history.md)."""
    from dflash.step.objective import HostCopy

    dev = torch.device("cuda")
    x = torch.arange(35, device=dev, dtype=torch.float32) * 0.5 - 3.0
    n = torch.tensor(7, device=dev)
    a, b = HostCopy(x), HostCopy(n)
    assert a.by_kernel and b.by_kernel
    assert torch.equal(a.get(), x.cpu()) and b.get().dtype == torch.int64 and int(b.get()) == 7
    big = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty(big.shape, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        dst.copy_(big, non_blocking=True)
    copy_end = side.record_event()
    c = HostCopy(x + 1)
    got = c.get()
    copy_running = not copy_end.query()
    torch.cuda.synchronize()
    assert torch.equal(got, (x + 1).cpu())
    assert copy_running, "the read waited behind the other stream's copy"


@pytest.mark.gpu
def test_reading_a_step_waits_for_that_step_only(repo):
    """read_step waits for its own step's end, not for work queued on the device after it (StepAhead
    queues the next step before reading this one: a read that waited for it lost the lead; H200 run
    of 2026-12-02 in docs/benchmarks-history.md). About a second of device sleep behind the step is still
    running when the read returns."""
    dev = torch.device("cuda")
    trainer, spec = _trainer(repo, dev, torch.bfloat16)
    (batch,) = _batches(spec, 1, torch.bfloat16)
    trainer.train_step(*batch)  # compiles
    torch.cuda.synchronize()
    queued = trainer.queue_step(*batch)
    torch.cuda._sleep(int(2e9))  # clock cycles: about 1 s at the H200's 1.98 GHz
    after = torch.cuda.Event()
    after.record()
    r = trainer.read_step(queued)
    still_running = not after.query()
    torch.cuda.synchronize()
    assert still_running, "reading the step waited for the work queued after it"
    assert r.step == 2 and math.isfinite(r.loss)


@pytest.mark.gpu
def test_the_fused_qk_norm_rope_trains_as_the_module_path(repo):
    """attention.fused_qk_norm_rope on and off, the same batches from the same initial weights: losses
    and gradient norms agree to bf16's precision over a few steps (the kernels round as the module
    path does; a float32 sum in another order moves a rounding here and there)."""
    dev = torch.device("cuda")
    runs = []
    for fused in ("true", "false"):
        trainer, spec = _trainer(repo, dev, torch.bfloat16, f"attention.fused_qk_norm_rope={fused}")
        assert trainer.model.backend.fused_qk_norm_rope == (fused == "true")
        runs.append([trainer.train_step(*b) for b in _batches(spec, 3, torch.bfloat16)])
    for a, b in zip(*runs, strict=True):
        assert abs(a.loss - b.loss) < 2e-3 * abs(b.loss), (a.loss, b.loss)
        assert abs(a.grad_norm - b.grad_norm) < 2e-2 * b.grad_norm, (a.grad_norm, b.grad_norm)
