import pytest

from dflash.config import load_config
from dflash.errors import ConfigError


def _write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


BASE = '[target]\npath = "tiny"\n[data]\npath = "demo"\n'


def test_shipped_configs_load(repo):
    for name in ("demo-cpu", "qwen3-8b", "qwen3.6-27b-5t3d"):
        cfg = load_config(repo / "configs" / f"{name}.toml")
        assert cfg.run.name == name
    field = load_config(repo / "configs" / "qwen3.6-27b-5t3d.toml")
    assert (field.pipeline.targets, field.pipeline.drafters) == (5, 3)
    assert (field.train.token_budget, field.train.max_batch_size) == (49152, 64)
    assert field.drafter.layer_types.count("sliding_attention") == 4
    assert field.drafter.layer_types[-1] == "full_attention"


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, BASE + "[train]\ntotal_step = 3\n"))
    assert e.value.key == "train.total_step"
    assert "total_steps" in str(e.value)  # the message lists the known keys


def test_bad_value_is_named(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, BASE + '[train]\ntoken_budget = "big"\n'))
    assert e.value.key == "train.token_budget"
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, BASE + '[attention]\nbackend = "flash"\n'))
    assert e.value.key == "attention.backend"


def test_missing_required(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, '[target]\npath = "tiny"\n'))
    assert e.value.key == "data"


def test_overrides_win_over_file(tmp_path):
    cfg = load_config(
        _write(tmp_path, BASE + "[train]\ntotal_steps = 3\n"),
        [
            "train.total_steps=7",
            "drafter.layer_types=['full_attention']",
            "drafter.num_layers=1",
            "run.name=x-y",
        ],
    )
    assert cfg.train.total_steps == 7
    assert cfg.drafter.layer_types == ["full_attention"]
    assert cfg.run.name == "x-y"
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, BASE), ["train.nope=1"])
    assert e.value.key == "train.nope"
    with pytest.raises(ConfigError):
        load_config(_write(tmp_path, BASE), ["no-equals-sign"])


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_write(tmp_path, "[run\n"))


def test_bf16_weights_resolves_on_for_a_single_gpu_drafter_only(repo):
    """auto: bf16 weights where a single drafter runs on a GPU (same results); a drafter group
    stays on float32 weights (its gradients would be averaged in bf16); false is false anywhere."""
    import torch

    from dflash.plan.resolve import resolve_bf16_weights

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    single = load_config(repo / "configs" / "qwen3-8b.toml")
    group = load_config(repo / "configs" / "qwen3.6-27b-5t3d.toml")
    assert resolve_bf16_weights(single, cuda) and not resolve_bf16_weights(single, cpu)
    assert not resolve_bf16_weights(group, cuda)
    forced = load_config(repo / "configs" / "qwen3.6-27b-5t3d.toml", ["train.bf16_weights=true"])
    assert resolve_bf16_weights(forced, cuda)
    off = load_config(repo / "configs" / "qwen3-8b.toml", ["train.bf16_weights=false"])
    assert not resolve_bf16_weights(off, cuda)
    with pytest.raises(ConfigError) as e:
        resolve_bf16_weights(forced, cpu)
    assert e.value.key == "train.bf16_weights"


def test_flex_kernels_are_dflash_on_a_gpu_and_flex_elsewhere(repo):
    """auto: dflash's own kernels on a GPU, flex's on the CPU (dflash's run there only through Triton's
    interpreter); either when set; a value that is neither is refused with its key named."""
    import torch

    from dflash.plan.resolve import resolve_flex_kernels

    cfg = load_config(repo / "configs" / "qwen3-8b.toml")
    assert resolve_flex_kernels(cfg, torch.device("cuda")) == "dflash"
    assert resolve_flex_kernels(cfg, torch.device("cpu")) == "flex"
    forced = load_config(repo / "configs" / "qwen3-8b.toml", ["attention.flex_kernels=flex"])
    assert resolve_flex_kernels(forced, torch.device("cuda")) == "flex"
    forced = load_config(repo / "configs" / "qwen3-8b.toml", ["attention.flex_kernels=dflash"])
    assert resolve_flex_kernels(forced, torch.device("cpu")) == "dflash"
    with pytest.raises(ConfigError) as e:
        load_config(repo / "configs" / "qwen3-8b.toml", ["attention.flex_kernels=triton"])
    assert e.value.key == "attention.flex_kernels" and "flex, dflash or auto" in str(e.value)


def test_the_fused_qk_norm_rope_is_auto_on_with_dflash_kernels_and_refused_where_it_would_do_nothing(repo):
    """auto (the default) is on exactly where dflash's attention kernels run and the head dim suits
    the kernel; false is off; true where those kernels do not run is refused before any worker
    starts, naming the key and what to do instead; any other value is refused."""
    import torch

    from dflash.plan import resolve

    def resolve_fused_qk_norm_rope(cfg, device, head_dim=None):
        """As dflash.plan.builder asks it: with the backend and kernels the plan resolved (on the CPU the
        shipped flex backend is refused by its own check, so no backend)."""
        backend = resolve.resolve_backend(cfg, device) if device.type == "cuda" else None
        kernels = resolve.resolve_flex_kernels(cfg, device)
        return resolve.resolve_fused_qk_norm_rope(cfg, device, head_dim, backend=backend, kernels=kernels)

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    shipped = repo / "configs" / "qwen3-8b.toml"
    assert load_config(shipped).attention.fused_qk_norm_rope == "auto"
    assert resolve_fused_qk_norm_rope(load_config(shipped), cuda)
    assert resolve_fused_qk_norm_rope(load_config(shipped), cuda, 128)
    assert not resolve_fused_qk_norm_rope(load_config(shipped), cuda, 96)  # not a power of two
    for sets, device in (
        ([], cpu),
        (["attention.backend=auto"], cpu),
        (["attention.flex_kernels=flex"], cuda),
        (["attention.backend=sdpa"], cuda),
        (["attention.fused_qk_norm_rope=false"], cuda),
    ):
        assert not resolve_fused_qk_norm_rope(load_config(shipped, sets), device), sets
    on = ["attention.fused_qk_norm_rope=true"]
    assert resolve_fused_qk_norm_rope(load_config(shipped, on), cuda)
    for sets, device, says in (
        (["attention.backend=auto"], cpu, "GPU only (this job runs on cpu): set it false or auto"),
        (["attention.flex_kernels=flex"], cuda, "flex_kernels=flex): set attention.flex_kernels=dflash"),
        (["attention.backend=sdpa"], cuda, "attention.backend=sdpa, flex_kernels=dflash): set"),
    ):
        with pytest.raises(ConfigError) as e:
            resolve_fused_qk_norm_rope(load_config(shipped, on + sets), device)
        assert e.value.key == "attention.fused_qk_norm_rope" and says in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(shipped, ["attention.fused_qk_norm_rope=sometimes"])
    assert e.value.key == "attention.fused_qk_norm_rope" and "true, false or auto" in str(e.value)
