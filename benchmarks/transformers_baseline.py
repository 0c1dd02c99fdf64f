"""The baseline both decode benchmarks measure against: transformers ``generate``, greedy, exactly
``new_tokens`` per sequence, returning the logits too (the engines return logprobs)."""

from __future__ import annotations

import torch


@torch.inference_mode()
def generate_greedy(model, input_ids: torch.Tensor, new_tokens: int) -> None:
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape[1] == input_ids.shape[1] + new_tokens
