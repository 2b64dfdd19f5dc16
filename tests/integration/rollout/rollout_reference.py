"""HF transformers reference logprobs for the rollout integration tests."""

import torch


@torch.no_grad()
def hf_token_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0,
                      suppressed: tuple[int, ...] = ()) -> list[float]:
    """log p(output[i] | prompt + output[:i]) under `model`, logits divided by `temperature`;
    `suppressed` token ids get -inf first (what vLLM's min_tokens processor does to EOS, and what
    its processed logprobs therefore reflect)."""
    ids = torch.tensor([list(prompt) + list(output)])
    logits = model(input_ids=ids).logits[0].float() / temperature
    if suppressed:
        logits[:, list(suppressed)] = float("-inf")
    lp = torch.log_softmax(logits, -1)
    p = len(prompt)
    return [float(lp[p - 1 + i, t]) for i, t in enumerate(output)]
