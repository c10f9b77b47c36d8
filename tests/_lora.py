"""Random LoRA weights for the tests, in diffusers' format (made with peft, offline)."""

import copy

import torch

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def lora_state_dict(model, seed: int, targets=LORA_TARGETS, prefix: str | None = "transformer", rank: int = 4):
    """A random LoRA for ``model`` in diffusers' format (peft keys, as ``save_lora_weights`` writes them)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    probe = copy.deepcopy(model)
    probe.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets), init_lora_weights=False),
                      adapter_name="probe")
    g = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(v.shape, generator=g) * 0.2 for k, v in get_peft_model_state_dict(probe, adapter_name="probe").items()}
    return {f"{prefix}.{k}" if prefix else k: v for k, v in sd.items()}
