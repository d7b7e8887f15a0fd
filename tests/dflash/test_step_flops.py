"""bench/drafter_step.py's FLOP count is the model's: its linears and head equal the matrix products
the job's own step really runs (counted by torch's FlopCounterMode over one DrafterTrainer step of
the bench's tiny drafter on the CPU)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from drafter_step import build_trainer, step_flops  # noqa: E402

from dflash.step.objective import block_labels, sample_anchors  # noqa: E402


def test_linear_and_head_flops_are_the_steps_own_matrix_products():
    """fc with its weight gradient only (the target's features need none), q/k/v/o and the MLP with
    both gradients, the frozen head forward and input gradient over the trained positions only. A
    row of the batch is cut short so that some blocks run past its end: those positions are not
    trained (nor are those on a hole of the loss mask), and the head must not be counted for them (the first count did, and took the fc's
    input gradient too)."""
    args = argparse.Namespace(
        batch=2, seq_len=64, anchors=8, loss_chunk=64, sdpa_chunk_blocks=4, tiny=True, set=[]
    )
    trainer, _cfg, batch = build_trainer(args, "sdpa")
    batch["seq_lens_B"] = torch.tensor([64, 40])
    batch["loss_mask_BL"][1, 40:] = False
    batch["loss_mask_BL"][1, ::5] = False  # holes: a block across one trains only some positions
    state = trainer.anchor_gen.get_state()
    with FlopCounterMode(display=False) as counter:
        trainer.train_step(**batch)
    gen = torch.Generator().manual_seed(0)
    gen.set_state(state)  # the anchors the step sampled
    anchors = sample_anchors(batch["loss_mask_BL"], batch["seq_lens_B"], args.anchors, gen)
    _, valid = block_labels(
        batch["input_ids_BL"], batch["loss_mask_BL"], batch["seq_lens_B"], anchors, trainer.spec.block_size
    )
    trained = int(valid.sum())
    assert 0 < trained < anchors.numel() * (trainer.spec.block_size - 1), "some positions are not trained"
    counts = counter.get_flop_counts()["Global"]
    ran = sum(n for op, n in counts.items() if str(op).split(".")[1] in ("mm", "addmm"))
    f = step_flops(trainer.spec, args.batch, args.seq_len, anchors, batch["seq_lens_B"], trained)
    assert f["linears"] + f["lm_head"] == ran
    assert f["trained_positions"] == trained
    assert f["total_first_count"] > f["total"]
