"""SmolLM2-135M-Instruct (scripts/get_smollm2.sh, 4-bit GGUF weights dequantized) against
transformers' GGUF-loaded model, on the cases of tests/reference/smollm2_cases.py: the max
logit difference of `load_hf` + forward (f32), and how many greedy answers of the embedded
engine (bf16 and fp8_block recipes, f32) equal transformers' `generate`, with their finish
reasons and texts. Needs the vLLM venv (transformers runs there).

    .venv/bin/python benchmarks/smollm2_agreement.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
for sub in ("tests/reference", "tests/models", "tests/rollout_bridge", "."):
    sys.path.insert(0, str(REPO / sub))  # "." last: this checkout's packages come first

from _model_testlib import forward  # noqa: E402
from client import run_reference  # noqa: E402
from smollm2_cases import GREEDY, MAX_NEW_TOKENS, logits_batch, reference  # noqa: E402

from jfp8rl.data.records import Example  # noqa: E402
from jfp8rl.data.templates import PromptFormat  # noqa: E402
from models import fp8  # noqa: E402
from models.hf_io import load_hf  # noqa: E402
from models.tokenizer import load_tokenizer  # noqa: E402
from rollout_bridge.backend import SamplingParams  # noqa: E402
from rollout_bridge.engine.embedded import EmbeddedBackend  # noqa: E402


def main() -> None:
    script = REPO / "scripts" / "get_smollm2.sh"
    folder = subprocess.run([str(script)], capture_output=True, text=True, check=True)
    d = Path(folder.stdout.strip().splitlines()[-1])
    tok = load_tokenizer(d)
    fmt = PromptFormat(d, tok)
    prompts = [fmt.encode([Example(c[-1]["content"], "", {}, tuple(c))], 512)[0] for c in GREEDY]
    meta, ref = reference(lambda kind, **kw: run_reference(kind, **kw), tok, prompts)
    _, graphdef, params = load_hf(d, compute_dtype=jnp.float32)
    tokens, mask = logits_batch(tok)
    ours = np.asarray(forward(graphdef, params, tokens, mask, recipe=fp8.BF16))
    real = mask.astype(bool)
    err = float(np.abs(ours - ref["logits"])[real].max())
    print(f"max |logit diff| f32: {err:.2e} over {int(real.sum())} positions")
    for recipe in ("bf16", "fp8_block"):
        engine = EmbeddedBackend.from_hf_dir(
            d, recipe=recipe, config_overrides={"compute_dtype": jnp.float32}, max_len=256
        )
        out = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
        engine.close()
        same = sum(c.response_ids.tolist() == r for c, r in zip(out, meta["greedy"], strict=True))
        print(f"{recipe}: greedy == transformers {same}/{len(out)}")
        for c in out:
            print(f"  {c.finish_reason:6s} {fmt.response_text(c.response_ids.tolist())!r}")


if __name__ == "__main__":
    main()
