"""The tiny target through the real loading path, layer capture against the full transformers forward,
and reading only the embedding / LM head from safetensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dflash.data.demo import make_tiny_target
from dflash.errors import DFlashError
from dflash.target import TargetCapture, load_frozen_head

LAYERS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("target") / "tiny", layers=LAYERS, hidden=64)


@pytest.fixture(scope="module")
def full_model(tiny: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32, local_files_only=True).eval()


def test_tiny_target_loads_through_auto_classes(tiny: Path, full_model) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny), local_files_only=True)
    assert tok.mask_token == "<|mask|>" and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.chat_template
    assert type(full_model).__name__ == "Qwen3ForCausalLM"
    cfg = full_model.config
    assert cfg.num_hidden_layers == LAYERS and cfg.hidden_size == 64 and cfg.vocab_size >= len(tok)
    assert not cfg.tie_word_embeddings
    assert list(tiny.glob("*.safetensors"))
    assert json.loads((tiny / "config.json").read_text())["dtype"] == "bfloat16"


def test_make_tiny_target_is_idempotent_and_rebuilds_on_change(tmp_path: Path) -> None:
    path = make_tiny_target(tmp_path / "t", layers=2)
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert make_tiny_target(tmp_path / "t", layers=2) == path
    assert weights.stat().st_mtime_ns == stamp
    make_tiny_target(tmp_path / "t", layers=3)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [".t.lock", "t"]  # no temp or aside dirs left


def _build_and_report_inode(path: str) -> int:
    built = make_tiny_target(Path(path), layers=1, hidden=32)
    return (built / "model.safetensors").stat().st_ino


def test_concurrent_builders_share_one_tiny_target(tmp_path: Path) -> None:
    """Launchers sharing a runs root start together: one builds, the others wait and use that build.
    (Before the lock a late builder swapped the directory out under a process already loading it.)"""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(3) as pool:
        inodes = pool.map_async(_build_and_report_inode, [str(tmp_path / "t")] * 3).get(timeout=600)
    assert len(set(inodes)) == 1, "every builder saw the same, single build"
    assert (tmp_path / "t" / "model.safetensors").stat().st_ino == inodes[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".t.lock", "t"]


def test_capture_matches_full_forward(tiny: Path, full_model) -> None:  # noqa: ANN001
    layer_ids = [3, 1, 2]  # out of order on purpose: the concat follows layer_ids
    cap = TargetCapture(str(tiny), layer_ids, dtype=torch.float32, device=torch.device("cpu"))
    assert len(cap.model.layers) == 4  # type: ignore[arg-type]  # layers after the last needed one are never loaded
    assert not hasattr(cap, "lm_head") and all(not p.requires_grad for p in cap.model.parameters())
    assert cap.config.num_hidden_layers == 4

    torch.manual_seed(0)
    lens = [21, 13, 5]
    ids_BL = torch.randint(0, 300, (3, 24))
    out_BLD = cap(ids_BL, torch.tensor(lens))
    assert out_BLD.shape == (3, 24, 3 * 64) and out_BLD.dtype == torch.float32
    for row, n in enumerate(lens):
        with torch.no_grad():
            hs = full_model(input_ids=ids_BL[row : row + 1, :n], output_hidden_states=True).hidden_states
        for slot, layer in enumerate(layer_ids):
            got = out_BLD[row, :n, slot * 64 : (slot + 1) * 64]
            torch.testing.assert_close(got, hs[layer + 1][0], rtol=1e-5, atol=1e-5)

    # A row padded to the full length gives the same real positions as the same row batched alone.
    alone = cap(ids_BL[1:2, :13], torch.tensor([13]))
    torch.testing.assert_close(out_BLD[1, :13], alone[0], rtol=1e-5, atol=1e-5)


def test_capture_in_bf16(tiny: Path, full_model) -> None:  # noqa: ANN001
    cap = TargetCapture(str(tiny), [0, 4], dtype=torch.bfloat16, device=torch.device("cpu"))
    ids_BL = torch.randint(0, 300, (2, 16))
    out = cap(ids_BL, torch.tensor([16, 16]))
    assert out.dtype == torch.bfloat16 and out.shape == (2, 16, 128)
    with torch.no_grad():
        hs = full_model(input_ids=ids_BL, output_hidden_states=True).hidden_states
    torch.testing.assert_close(out[..., 64:].float(), hs[5], rtol=0.05, atol=0.05)


def test_capture_errors(tiny: Path, tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(DFlashError, match="not a directory"):
        TargetCapture(str(tmp_path / "nope"), [0], dtype=torch.float32, device=cpu)
    with pytest.raises(DFlashError, match="no config.json"):
        TargetCapture(str(tmp_path), [0], dtype=torch.float32, device=cpu)
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    shutil.copy(tiny / "config.json", no_weights / "config.json")
    with pytest.raises(DFlashError, match="no \\*.safetensors"):
        TargetCapture(str(no_weights), [0], dtype=torch.float32, device=cpu)
    with pytest.raises(DFlashError, match=r"\[6\] are outside the target's layers 0..5"):
        TargetCapture(str(tiny), [1, 6], dtype=torch.float32, device=cpu)


def test_load_frozen_head_untied_and_sharded(tiny: Path, full_model, tmp_path: Path) -> None:  # noqa: ANN001
    embed, head, cfg = load_frozen_head(str(tiny), dtype=torch.float32, device="cpu")
    assert cfg.hidden_size == 64
    torch.testing.assert_close(embed, full_model.get_input_embeddings().weight, rtol=0, atol=0)
    torch.testing.assert_close(head, full_model.lm_head.weight, rtol=0, atol=0)
    assert not torch.equal(embed, head)

    sharded = tmp_path / "sharded"
    full_model.to(torch.bfloat16).save_pretrained(str(sharded), max_shard_size="40KB")
    full_model.float()
    assert (sharded / "model.safetensors.index.json").is_file() and len(
        list(sharded.glob("*.safetensors"))
    ) > 2
    embed2, head2, _ = load_frozen_head(str(sharded), dtype=torch.bfloat16, device="cpu")
    assert embed2.dtype == torch.bfloat16
    torch.testing.assert_close(embed2.float(), embed, rtol=0, atol=0)
    torch.testing.assert_close(head2.float(), head, rtol=0, atol=0)


def test_load_frozen_head_tied(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = make_tiny_target(tmp_path / "tied", layers=1, tie_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    embed, head, _ = load_frozen_head(str(path), dtype=torch.float32, device="cpu")
    torch.testing.assert_close(embed, model.get_input_embeddings().weight, rtol=0, atol=0)
    torch.testing.assert_close(head, model.lm_head.weight, rtol=0, atol=0)
    assert head is embed


@pytest.mark.gpu
def test_capture_on_cuda_matches_cpu(tiny: Path) -> None:
    ids_BL = torch.randint(0, 300, (4, 64))
    lens = torch.tensor([64, 40, 17, 3])
    cpu = TargetCapture(str(tiny), [1, 3], dtype=torch.float32, device=torch.device("cpu"))(ids_BL, lens)
    gpu = TargetCapture(str(tiny), [1, 3], dtype=torch.bfloat16, device=torch.device("cuda"))(ids_BL, lens)
    assert gpu.device.type == "cuda" and gpu.dtype == torch.bfloat16
    for row, n in enumerate(lens.tolist()):
        torch.testing.assert_close(gpu[row, :n].float().cpu(), cpu[row, :n], rtol=0.05, atol=0.05)


def test_compiled_capture_matches_eager(tiny: Path) -> None:
    """target.compile = true compiles each decoder layer (real torch.compile on CPU): same states,
    padded batch and unpadded batch (the latter takes the plain causal path)."""
    eager = TargetCapture(str(tiny), [1, 3], dtype=torch.float32, device=torch.device("cpu"))
    compiled = TargetCapture(str(tiny), [1, 3], dtype=torch.float32, device=torch.device("cpu"), compile=True)
    torch.manual_seed(1)
    ids_BL = torch.randint(0, 300, (2, 16))
    for lens in ([16, 9], [16, 16]):
        want = eager(ids_BL, torch.tensor(lens))
        got = compiled(ids_BL, torch.tensor(lens))
        for row, n in enumerate(lens):
            torch.testing.assert_close(got[row, :n], want[row, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_compiled_capture_on_cuda_matches_eager_within_bf16_tolerance(tiny: Path) -> None:
    """target.compile as a GPU job resolves it (bf16, compiled decoder layers): the captured states
    equal the eager bf16 capture's within bf16 tolerance, padded and unpadded (issue 38 item 1)."""
    cuda = torch.device("cuda")
    eager = TargetCapture(str(tiny), [1, 3], dtype=torch.bfloat16, device=cuda)
    compiled = TargetCapture(str(tiny), [1, 3], dtype=torch.bfloat16, device=cuda, compile=True)
    torch.manual_seed(2)
    ids_BL = torch.randint(0, 300, (4, 64))
    for lens in ([64, 40, 17, 3], [64, 64, 64, 64]):
        want = eager(ids_BL, torch.tensor(lens))
        got = compiled(ids_BL, torch.tensor(lens))
        assert got.dtype == torch.bfloat16
        for row, n in enumerate(lens):
            torch.testing.assert_close(got[row, :n].float(), want[row, :n].float(), rtol=1.6e-2, atol=2e-2)
