"""Rollout dumps: what the policy wrote, as `<run_dir>/rollouts/step_<step>.jsonl`.

`logging.rollout_samples: k` writes the first ceil(k / n) groups of the step's batch (n =
rollout.n; a GRPO group is judged as a whole, so k is rounded UP to whole groups and capped at
the batch), all n samples of a prompt together, prompt-major as the batch holds them. One JSON
object per sample:

    group, sample        group index in the batch, sample index in the group
    prompt_ids           the token ids the rollout backend received and the trainer scored
    prompt_text          their decoded text, special tokens kept (the rendered chat template)
    response_ids         sampled ids (the stop token included when one ended the response)
    response_text        the text the verifier judged (up to the first stop token)
    answer               the reference answer
    reward, correct      reward (with overlong shaping) and verifier correctness
    advantage            the sequence advantage used in the loss (0 for a group left out)
    in_loss              false for a dynamic-sampling filler group (response mask zero)
    unparsed             no answer the verifier could extract (math: no parsable \\boxed{})
    finish_reason        "stop" | "length"
    weight_version       the weights the sample was drawn with ("step-<k>")
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from jfp8rl.data.batch import RolloutBatch
from jfp8rl.data.templates import PromptFormat


def dump_groups(samples: int, n: int, groups: int) -> int:
    """Groups written for `logging.rollout_samples = samples`: ceil(samples / n), at most all."""
    return min(groups, math.ceil(samples / n))


def write_rollouts(
    run_dir: str | Path,
    step: int,
    batch: RolloutBatch,
    advantages: np.ndarray,
    fmt: PromptFormat,
    samples: int,
    n: int,
) -> Path:
    """Writes the dump of `step` (module docstring); `advantages` is the loss's [N, R] token
    advantages (constant along a response). Returns the file's path."""
    out = Path(run_dir) / "rollouts" / f"step_{step}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    count = dump_groups(samples, n, len(batch.completions) // n) * n
    lines = []
    for i in range(count):
        c = batch.completions[i]
        in_loss = bool(batch.response_mask[i].any())
        record = {
            "step": step,
            "group": i // n,
            "sample": i % n,
            "prompt_ids": [int(t) for t in c.prompt_ids],
            "prompt_text": fmt.decode(c.prompt_ids),
            "response_ids": [int(t) for t in c.response_ids],
            "response_text": batch.texts[i],
            "answer": batch.answers[i],
            "reward": float(batch.rewards[i]),
            "correct": float(batch.correct[i]),
            "advantage": float(advantages[i, 0]) if in_loss else 0.0,
            "in_loss": in_loss,
            "unparsed": bool(batch.unparsed[i]),
            "finish_reason": c.finish_reason,
            "weight_version": c.weight_version,
        }
        lines.append(json.dumps(record, ensure_ascii=False))
    tmp = out.with_suffix(".jsonl.tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(out)  # a resumed step rewrites its dump whole
    return out
