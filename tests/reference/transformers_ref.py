"""transformers' side of the reference tests, run in the vLLM venv (Python 3.11, torch 2.13 cpu).

The project venv (Python 3.12, jax 0.11.2) carries no torch: PyTorch has a CPU wheel for
Python 3.11 only on these machines. So every comparison with transformers runs its PyTorch side
here, in a subprocess started by `tests/reference/client.py`, and exchanges plain files: a JSON
job in, `result.json` + `result.npz` out (numpy arrays, loaded with `allow_pickle=False`).
This file imports only torch, transformers and numpy (never our packages: they need jax).

Usage (the client does this): `<vllm-venv>/bin/python transformers_ref.py JOB.json OUT_DIR`, or
`transformers_ref.py --serve`: one process (one torch/transformers import) for many jobs, each a
stdin line `["JOB.json", "OUT_DIR"]` (JSON), answered by a stdout line `ok` or `error <message as JSON>`. A job
reads nothing that an earlier one left (each seeds torch itself, loads its own folder).

Jobs (`kind`):
- `logits`: `folder`, `tokens` / `mask` (.npy paths) -> `logits` [B, T, V] f32. Eager attention,
  positions `cumsum(mask) - 1` clipped at 0 (as `models.functional.positions_from_mask`).
- `random_init`: `hf_config` (dict for `AutoConfig.for_model`), `seed`, `folder` -> transformers
  initialises the model, perturbs norms and biases by 0.1 N(0, 1) (HF inits them to 1 / 0, which
  would hide a wrong name map), saves it to `folder` (safetensors); then like `logits` when
  `tokens` is given.
- `load_balancing`: `gate_logits` [L, B * T, E] f32, `mask` [B, T], `num_experts`, `top_k` ->
  `loss` of Qwen3-MoE's `load_balancing_loss_func` (the layers' logits as its tuple) and
  `grad`, its gradient with respect to the logits.
- `tokenize`: `folder`, `texts` -> `input_ids` (list of lists, `add_special_tokens=True`),
  `decoded` (decode of each), `eos_token_id`, `pad_token_id`.
- `chat_template`: `folder`, `conversations` (list of message lists), `kwargs` (extra template
  variables, e.g. `enable_thinking`) -> `input_ids` of
  `apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)` and
  `text` of the same with `tokenize=False`, the tokenizer's `eos_token_id` and
  `generation_eos_token_id` (`GenerationConfig.from_pretrained(folder).eos_token_id`, None
  without a generation_config.json).
- `gguf`: `gguf_file` (a .gguf path; needs gguf and accelerate in this venv) loaded with
  transformers' GGUF loader (f32, eager attention, the GGUF's own tokenizer), or `model_dir`
  (an HF folder that transformers' GGUF loader wrote, loaded as it is: the same values,
  without dequantizing again), once, for all of:
  `tokens` / `mask` -> `logits` as `logits`; `texts` -> `input_ids` as `tokenize`;
  `conversations` -> `chat_ids` as `chat_template` (`chat_eos_token_id` its tokenizer's eos);
  `prompts` (lists of ids), `max_new_tokens` -> `greedy`: each prompt's greedy answer of
  `generate(do_sample=False)` alone (batch of one), new tokens only, with the generation
  config's end of turn, and `generation_eos_token_id` that config's eos.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers


def _logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(pos, dtype=torch.long),
        )
    return out.logits.float().numpy()


def _load_model(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _inputs(job: dict) -> tuple[np.ndarray, np.ndarray]:
    return np.load(job["tokens"], allow_pickle=False), np.load(job["mask"], allow_pickle=False)


def job_logits(job: dict) -> tuple[dict, dict]:
    return {}, {"logits": _logits(_load_model(job["folder"]), *_inputs(job))}


def job_random_init(job: dict) -> tuple[dict, dict]:
    torch.manual_seed(int(job["seed"]))
    hf_cfg = transformers.AutoConfig.for_model(**job["hf_config"])
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(job["folder"])
    arrays = {}
    if "tokens" in job:
        arrays["logits"] = _logits(_load_model(job["folder"]), *_inputs(job))
    return {}, arrays


def job_load_balancing(job: dict) -> tuple[dict, dict]:
    """`load_balancing_loss_func` of transformers' Qwen3-MoE on given router logits."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = torch.tensor(np.load(job["gate_logits"], allow_pickle=False), requires_grad=True)
    mask = torch.tensor(np.load(job["mask"], allow_pickle=False), dtype=torch.long)
    loss = load_balancing_loss_func(
        tuple(logits), int(job["num_experts"]), int(job["top_k"]), attention_mask=mask
    )
    loss.backward()
    return {}, {"loss": loss.detach().numpy(), "grad": logits.grad.numpy()}


def job_tokenize(job: dict) -> tuple[dict, dict]:
    tok = transformers.AutoTokenizer.from_pretrained(job["folder"])
    ids = [tok(t, add_special_tokens=True)["input_ids"] for t in job["texts"]]
    return {
        "input_ids": ids,
        "decoded": [tok.decode(i) for i in ids],
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }, {}


def job_chat_template(job: dict) -> tuple[dict, dict]:
    tok = transformers.AutoTokenizer.from_pretrained(job["folder"])
    kwargs = job.get("kwargs", {})
    ids, texts = [], []
    for messages in job["conversations"]:
        out = tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False, **kwargs
        )
        ids.append([int(i) for i in out])
        texts.append(
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        )
    gen = Path(job["folder"]) / "generation_config.json"
    gen_eos = transformers.GenerationConfig.from_pretrained(job["folder"]).eos_token_id
    return {
        "input_ids": ids,
        "text": texts,
        "eos_token_id": tok.eos_token_id,
        "generation_eos_token_id": gen_eos if gen.is_file() else None,
    }, {}


def job_gguf(job: dict) -> tuple[dict, dict]:
    if "model_dir" in job:
        src, kw = Path(job["model_dir"]), {}
    else:
        path = Path(job["gguf_file"])
        src, kw = path.parent, {"gguf_file": path.name}
    tok = transformers.AutoTokenizer.from_pretrained(src, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager", **kw
    ).eval()
    meta: dict = {"eos_token_id": tok.eos_token_id}
    arrays: dict = {}
    if "tokens" in job:
        arrays["logits"] = _logits(model, *_inputs(job))
    meta["input_ids"] = [tok(t, add_special_tokens=True)["input_ids"] for t in job.get("texts", [])]
    meta["chat_ids"] = [
        [int(i) for i in tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False)]
        for m in job.get("conversations", [])
    ]  # fmt: skip
    meta["generation_eos_token_id"] = model.generation_config.eos_token_id
    greedy = []
    for prompt in job.get("prompts", []):
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=int(job["max_new_tokens"]), pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        greedy.append([int(t) for t in out[0, len(prompt) :]])
    meta["greedy"] = greedy
    return meta, arrays


JOBS = {
    "logits": job_logits,
    "random_init": job_random_init,
    "load_balancing": job_load_balancing,
    "tokenize": job_tokenize,
    "chat_template": job_chat_template,
    "gguf": job_gguf,
}


def main(job_path: str, out_dir: str) -> None:
    job = json.loads(Path(job_path).read_text())
    meta, arrays = JOBS[job["kind"]](job)
    out = Path(out_dir)
    meta["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    np.savez(out / "result.npz", **arrays)
    (out / "result.json").write_text(json.dumps(meta))


def serve() -> None:
    """The `--serve` loop (module docstring). Anything the jobs print goes to stderr, so that
    stdout carries the answers only."""
    import os
    import traceback

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        job_path, out_dir = json.loads(line)
        try:
            main(job_path, out_dir)
            answer = "ok"
        except Exception:  # noqa: BLE001 (sent to the client, which raises it)
            answer = "error " + json.dumps(traceback.format_exc())
        answers.write(answer + "\n")
        answers.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(*sys.argv[1:3])
