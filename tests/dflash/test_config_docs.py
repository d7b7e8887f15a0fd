"""Every speed default that was measured says so where users read the setting: its docstring in
dflash/config.py carries the measured figures, and those figures are the ones docs/BENCHMARKS.md
recorded (a docstring number that the measurements do not hold is a defect)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# key -> figures its docstring gives, each also in docs/BENCHMARKS.md (the measured-win or the
# slower-default's cost).
MEASURED = {
    "target.compile": ["1.32x"],
    "attention.backend": ["272.2 ms", "336.4 ms", "1.24x"],
    "attention.tuned_kernels": ["289.0", "276.7"],
    "attention.fused_qk_norm_rope": ["3.2 ms", "1.9"],
    "train.fused_loss": ["67.2", "8.0", "340.2", "56.1 GiB", "38.7"],
    "train.loss_chunk_tokens": ["260.5 ms", "259.5", "36.5 GiB", "34.2"],
    "train.bf16_weights": ["3.5 ms"],
    "train.tau_eval": ["104.5 s", "106.2 s", "+1.6%", "28.3%", "0.57%", "6.8%", "0.14%"],
    "pipeline.state_copy_every": ["+84.5%", "+8.7%", "0.48 s", "12.6 GB", "+27.0%", "+22.0%", "0.21 s"],
    "pipeline.spare_drafters": ["7.7", "0.8"],
}


def field_docs() -> dict[str, str]:
    """'section.key' -> the docstring under the field, read from the source as users read it."""
    tree = ast.parse((REPO / "dflash" / "config.py").read_text())
    out: dict[str, str] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        section = next(
            (
                s.value.value
                for s in cls.body
                if isinstance(s, ast.AnnAssign) and getattr(s.target, "id", "") == "SECTION"
            ),
            None,
        )
        if section is None:
            continue
        for a, b in zip(cls.body, cls.body[1:], strict=False):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                out[f"{section}.{a.target.id}"] = " ".join(str(b.value.value).split())  # type: ignore[union-attr]
    return out


@pytest.mark.parametrize("key", sorted(MEASURED))
def test_a_measured_default_gives_its_figures_and_benchmarks_holds_them(key):
    docs = field_docs()
    assert key in docs, f"{key} has no docstring in dflash/config.py"
    bench = "".join((REPO / "docs" / name).read_text() for name in ("BENCHMARKS.md", "benchmarks-history.md"))
    for figure in MEASURED[key]:
        assert figure in docs[key], f"{key}'s docstring does not give {figure}"
        assert figure in bench, f"{key}'s {figure} is not a figure docs/BENCHMARKS.md or its history recorded"
