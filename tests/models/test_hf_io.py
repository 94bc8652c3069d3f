"""HF folders (models.hf_io): bit-exact round trips, shards, bf16 files, errors that name the
tensor and the file, and params that stay donatable after a load or an export."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _model_testlib import TINY, tiny
from safetensors.numpy import save_file

from models.hf_io import load_hf, read_safetensors, save_hf
from models.hf_state import iter_hf_state, to_hf_state_dict
from models.tokenizer import build_byte_tokenizer, load_tokenizer


def _assert_bit_exact(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", TINY)
def test_save_load_round_trip_is_bit_exact(name, tmp_path):
    cfg, graphdef, params = tiny(name)
    save_hf(tmp_path, cfg, params, tokenizer=build_byte_tokenizer())
    cfg2, graphdef2, params2 = load_hf(tmp_path, compute_dtype=cfg.compute_dtype)
    assert cfg2 == cfg
    assert graphdef2 == graphdef
    _assert_bit_exact(params, params2)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["model_type"] == cfg.arch
    assert hf_cfg["architectures"] == [
        {
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "llama": "LlamaForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM",
            "mixtral": "MixtralForCausalLM",
        }[cfg.arch]
    ]
    assert load_tokenizer(tmp_path).encode("7*6=42").ids == list(b"7*6=42")


def test_sharded_save_loads_back(tmp_path):
    cfg, _, params = tiny("tiny_qwen3")
    save_hf(tmp_path, cfg, params, max_shard_bytes=100_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    _assert_bit_exact(params, load_hf(tmp_path, compute_dtype=cfg.compute_dtype)[2])


def test_bf16_checkpoint_reads_as_bf16_values(tmp_path):
    cfg, _, params = tiny("tiny_llama")
    sd = to_hf_state_dict(cfg, params)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config("bfloat16")))
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in sd.items()}
    save_file(bf16, str(tmp_path / "model.safetensors"))
    back = read_safetensors(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(
        back["lm_head.weight"].astype(np.float32), bf16["lm_head.weight"].astype(np.float32)
    )
    loaded = to_hf_state_dict(cfg, load_hf(tmp_path)[2])
    for k in sd:
        np.testing.assert_array_equal(loaded[k], bf16[k].astype(np.float32))


def test_wrong_shape_names_tensor_shapes_and_file(tmp_path):
    cfg, _, params = tiny("tiny_qwen2")
    save_hf(tmp_path, cfg, params)
    sd = read_safetensors(tmp_path / "model.safetensors")
    sd["model.layers.1.mlp.gate_proj.weight"] = np.zeros((128, 32), np.float32)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_hf(tmp_path)
    msg = str(e.value)
    assert "model.layers.1.mlp.gate_proj.weight" in msg
    assert "(128, 32)" in msg and "(128, 64)" in msg
    assert "model.safetensors" in msg


def test_missing_folder_files_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path)
    cfg = tiny("tiny_qwen2")[0]
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf(tmp_path)


def _donated(tree) -> list[bool]:
    """Runs a donating jit over `tree`; which leaves it could consume (freed, not copied)."""
    leaves = jax.tree.leaves(tree)
    jax.block_until_ready(jax.jit(lambda t: [x + 1 for x in t], donate_argnums=0)(leaves))
    return [x.is_deleted() for x in leaves]


def test_loaded_and_exported_params_stay_donatable(tmp_path):
    # The trainer donates its params to every update; a buffer that something else still
    # references is copied instead (a second model in host memory on CPU). Neither the
    # memory-mapped load nor an export whose tensors are still held may leave such a reference.
    cfg, _, params = tiny("tiny_qwen3")
    save_hf(tmp_path, cfg, params)
    _, _, loaded = load_hf(
        tmp_path, mesh=jax.make_mesh((1,), ("fsdp",)), compute_dtype=cfg.compute_dtype
    )
    assert all(_donated(loaded))
    _, _, loaded = load_hf(tmp_path, compute_dtype=cfg.compute_dtype)
    held = to_hf_state_dict(cfg, loaded)  # the export's arrays stay alive
    assert all(_donated(loaded))
    np.testing.assert_array_equal(
        held["model.norm.weight"], np.asarray(params["model"]["norm"]["weight"][...])
    )
    # A bf16 weight push fetches bf16 tensors made on device (slice, transpose, round): the
    # same bits as ml_dtypes' round-to-nearest-even of the float32 HF tensors, and the params
    # stay donatable.
    _, _, loaded = load_hf(tmp_path, compute_dtype=cfg.compute_dtype)
    held16 = dict(iter_hf_state(cfg, loaded, dtype=jnp.bfloat16))
    assert all(_donated(loaded))
    assert list(held16) == list(held)
    for name, x in held.items():
        assert held16[name].dtype == ml_dtypes.bfloat16 and held16[name].shape == x.shape
        np.testing.assert_array_equal(
            held16[name].view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16)
        )


def test_save_writes_each_tensor_as_it_comes(tmp_path):
    """`save_hf` keeps no tensor of the stream once the next one is asked for (so host memory
    holds the tensors in flight, not a shard), in one file and in shards; the files read back
    with safetensors' own reader equal to the HF state dict; a stream out of `hf_shapes` order
    is refused naming both tensors, and no *.safetensors file is left."""
    import weakref

    from safetensors.numpy import load_file

    from models.hf_state import hf_shapes

    cfg, _, params = tiny("tiny_qwen3")
    want = to_hf_state_dict(cfg, params)
    assert [(n, x.shape) for n, x in want.items()] == hf_shapes(cfg)
    for max_shard_bytes, folder in ((5 * 2**30, tmp_path / "one"), (100_000, tmp_path / "shards")):
        alive: list[weakref.ref] = []

        def stream(alive=alive):
            for name, x in want.items():
                # Reference counts free a tensor the writer let go of (no collection needed,
                # and a full one per tensor would be most of the test's time).
                assert sum(r() is not None for r in alive) <= 1, name  # the one just written
                y = x.copy()
                alive.append(weakref.ref(y))
                yield name, y

        save_hf(folder, cfg, params, max_shard_bytes=max_shard_bytes, tensors=stream())
        got = {}
        for f in sorted(folder.glob("*.safetensors")):
            got.update(load_file(f))
        assert sorted(got) == sorted(want)
        for name, x in want.items():
            assert got[name].dtype == np.float32
            np.testing.assert_array_equal(got[name], x)
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 2

    swapped = list(want.items())
    swapped[1], swapped[2] = swapped[2], swapped[1]
    with pytest.raises(ValueError, match=rf"expected {swapped[2][0]!r}.*got {swapped[1][0]!r}"):
        save_hf(tmp_path / "bad", cfg, params, tensors=iter(swapped))
    assert not list((tmp_path / "bad").glob("*.safetensors"))
