"""`jfp8rl.export` and `jfp8rl.eval` on a small run of the tiny default.

References: the run's own `hf_final` (written from the in-memory final state; the export
restores the same step from the orbax checkpoint and must be byte-identical) and the run's own
last greedy `eval/accuracy` in metrics.jsonl (the eval CLI on the exported folder, with the
run's config, must reproduce it exactly: same FP8 export path, same prompts, greedy).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_run import TINY, small

from jfp8rl.data import arithmetic_split
from jfp8rl.eval import main as eval_main
from jfp8rl.export import main as export_main
from jfp8rl.metrics import read_metrics
from jfp8rl.train import main as train_main
from models.hf_io import read_safetensors


def test_export_then_eval_reproduce_the_run(
    cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = ["--config", str(TINY), *small(run_dir, cache_dir, "train.steps=2",
            "data.eval_size=64", "train.eval_every=0", "logging.tensorboard=false")]  # fmt: skip
    assert train_main(argv) == 0
    assert export_main([str(run_dir), "--step", "2"]) == 0
    exported = run_dir / "hf_step_2"
    a = read_safetensors(run_dir / "hf_final" / "model.safetensors")
    b = read_safetensors(exported / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).read_text() == (run_dir / "hf_final" / name).read_text()
    assert export_main([str(run_dir), "--step", "1"]) == 2
    assert "no checkpoint for step 1; saved steps: [0, 2]" in capsys.readouterr().err

    # The run's eval set (data.eval_size=64 held-out problems) as a data file.
    _, evals = arithmetic_split(2, 64)
    data = tmp_path / "eval.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in evals)
    )
    out = tmp_path / "eval.json"
    rc = eval_main(["--model", str(exported), "--data", str(data), "--config",
                    str(run_dir / "config.yaml"), "--out", str(out)])  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    last = [r for r in read_metrics(run_dir) if "eval/accuracy" in r][-1]
    assert last["step"] == 2 and res["problems"] == 64 and res["temperature"] == 0
    assert res["pass@1"] == res["avg@1"] == last["eval/accuracy"]
    assert 1 <= res["response_length/mean"] <= 6  # rollout.max_tokens of the run
