"""One instance of the reward model, in a process of its own (the harness's, never the candidate's).

It loads the judge's weights and tokenizer, says ``ready``, then answers one verdict per line read:
a JSON list of the policy's token ids (an episode's whole context) in, ``{"score": s}`` out. The
judge reads the context as text (decoded with the policy's tokenizer, encoded with its own, the
last ``max_position_embeddings`` tokens kept) and its verdict is the probability it gives ``1``
against ``0`` as its next token: a score in [0, 1] that the harness adds to what the environment
paid at the episode's last turn (``docs/targets.md``).

Run as ``python -m targets.harness.reward_model.judge_process JUDGE_DIR POLICY_DIR DEVICE DTYPE``.
"""

from __future__ import annotations

import json
import sys

VERDICT_TOKENS = ("1", "0")  # a single token in every tokenizer the harness builds or loads


def verdict_ids(tokenizer) -> tuple[int, int]:
    """The judge tokenizer's ids of ``1`` and ``0``; an error naming the tokenizer if either is not one token."""
    ids = []
    for word in VERDICT_TOKENS:
        encoded = tokenizer(word, add_special_tokens=False).input_ids
        if len(encoded) != 1:
            raise ValueError(f"the reward model's tokenizer reads {word!r} as {len(encoded)} tokens, not one")
        ids.append(encoded[0])
    return ids[0], ids[1]


def main(judge_dir: str, policy_dir: str, device: str, dtype: str) -> None:
    import torch

    from targets.harness.model import load_model, load_tokenizer

    torch.set_num_threads(1)  # one core's worth, as an engine's: the host's cores are the job's
    model = load_model(judge_dir, dtype).to(device)
    judge_tokenizer, policy_tokenizer = load_tokenizer(judge_dir), load_tokenizer(policy_dir)
    yes, no = verdict_ids(judge_tokenizer)
    window = model.config.max_position_embeddings
    print("ready", flush=True)
    for line in sys.stdin:
        context = json.loads(line)
        text = policy_tokenizer.decode(context)
        ids = judge_tokenizer(text, add_special_tokens=False).input_ids[-window:] or [no]
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device)).logits[0, -1]
        score = torch.softmax(logits[[yes, no]].float(), dim=0)[0].item()
        print(json.dumps({"score": score}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
