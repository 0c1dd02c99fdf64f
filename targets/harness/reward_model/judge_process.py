"""One instance of the reward model, in a process of its own (the harness's, never the candidate's).

It loads the judge's weights and tokenizer, says ``ready``, then answers one verdict per line read:
a JSON list of the policy's token ids (an episode's whole context) in, ``{"score": s}`` out, over two
pipes the harness gives it (its output is its log, whatever a library prints there). Forked warm by the
harness zygote for a run started by the launcher (``isolation/zygote.py``), else a fresh process. The
judge reads the context as text (decoded with the policy's tokenizer, encoded with its own, the
last ``max_position_embeddings`` tokens kept) and its verdict is the probability it gives ``1``
against ``0`` as its next token: a score in [0, 1] that the harness adds to what the environment
paid at the episode's last turn (``docs/targets.md``).

Run as ``python -m targets.harness.reward_model.judge_process JUDGE_DIR POLICY_DIR DEVICE DTYPE REQUESTS_FD
VERDICTS_FD``.
"""

from __future__ import annotations

import json
import os
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


def main(argv: list[str]) -> int:
    import torch

    from targets.harness.model import load_model, load_tokenizer

    judge_dir, policy_dir, device, dtype, requests_fd, verdicts_fd = argv
    torch.set_num_threads(1)  # one core's worth, as an engine's: the host's cores are the job's
    model = load_model(judge_dir, dtype).to(device)
    judge_tokenizer, policy_tokenizer = load_tokenizer(judge_dir), load_tokenizer(policy_dir)
    yes, no = verdict_ids(judge_tokenizer)
    window = model.config.max_position_embeddings
    with os.fdopen(int(requests_fd)) as requests, os.fdopen(int(verdicts_fd), "w", buffering=1) as verdicts:
        verdicts.write("ready\n")
        for line in requests:  # until the harness closes its end
            context = json.loads(line)
            text = policy_tokenizer.decode(context)
            ids = judge_tokenizer(text, add_special_tokens=False).input_ids[-window:] or [no]
            with torch.no_grad():
                logits = model(torch.tensor([ids], device=device)).logits[0, -1]
            score = torch.softmax(logits[[yes, no]].float(), dim=0)[0].item()
            verdicts.write(json.dumps({"score": score}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
