"""The PyTorch peer of `benchmarks/model_step.py --model DIR --peer torch`: transformers' model of
the same HF folder, the same loss on the same tokens, timed on request.

Runs in the vLLM venv (it has torch and transformers; the project venv has none), started by
model_step.py, which talks to it over stdin / stdout in JSON lines:

    start:   python benchmarks/torch_model_step.py --model DIR --tokens TOKENS.npy
    -> {"loss": L}                     the loss once (f32), after loading the model
    <- {"steps": N}                    time N forward+backward passes
    -> {"s_per_step": S}
    <- {"steps": 0}                    exit

The loss is `model_step`'s: minus the mean over [B, T] of the token log-probs, entry t =
log_softmax(logits at t - 1)[token t] for t >= 1 and 0 at t = 0 (`models.functional.token_logprobs`
with a full attention mask).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = torch.gather(logp, -1, tokens[:, 1:, None])[..., 0]
    return -picked.sum() / tokens.numel()  # entry 0 of every row counts as 0, as in JAX


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, help=".npy int32 [B, T]")
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(
        args.model, torch_dtype=torch.float32, attn_implementation="sdpa"
    )
    model.train(False)  # no dropout; gradients still flow
    tokens = torch.from_numpy(np.load(args.tokens).astype(np.int64))

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, tokens)
        loss.backward()
        return float(loss)

    print(json.dumps({"loss": step()}), flush=True)
    for line in sys.stdin:
        n = int(json.loads(line)["steps"])
        if n <= 0:
            break
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        print(json.dumps({"s_per_step": (time.perf_counter() - t0) / n}), flush=True)


if __name__ == "__main__":
    main()
